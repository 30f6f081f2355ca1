"""`digits-mlp`: scikit-learn's bundled 8x8 digits (1,797 images), a fixed 20% test split, an MLP classifier.

The data ship inside scikit-learn, so nothing is downloaded. The test split is fixed (seeded, stratified) so that
every node and every later reader measures accuracy on the same 360 images; shard i of n trains on every n-th
training sample (`gpuswarm.sdk.shard_indices`), so the shards are disjoint and cover the training set.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import numpy as np
import torch
from gpuswarm.proto.workloads import DigitsMLPParams
from gpuswarm.sdk import Context, Shard, Workload, shard_indices
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SPLIT_SEED = 0
TEST_FRACTION = 0.2


@cache
def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, x_test, y_train, y_test): the fixed split every node and every reader uses. Read-only arrays."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    parts = train_test_split(x, y.astype(np.int64), test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y)
    for part in parts:
        part.setflags(write=False)
    return tuple(parts)


def build_mlp(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


class DigitsMLP(Workload):
    """A two-layer perceptron on the digits; evaluate reports the test split's {"loss", "accuracy"}."""

    Params = DigitsMLPParams
    params: DigitsMLPParams

    def __init__(self, ctx: Context):
        if not isinstance(ctx.params, DigitsMLPParams):  # a dict from an older caller: validate it here
            ctx.params = DigitsMLPParams.model_validate(ctx.params or {})
        super().__init__(ctx)
        x_train, x_test, y_train, y_test = digits_split()
        self.train_size = len(x_train)
        self._x_train, self._y_train = torch.from_numpy(x_train.copy()), torch.from_numpy(y_train.copy())
        self._test_cpu = torch.from_numpy(x_test.copy()), torch.from_numpy(y_test.copy())
        self._test_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def build_model(self) -> torch.nn.Module:
        # The job's own `seed` param decides the initial weights (the same on every member), as it always has.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.params.seed)
            return build_mlp(self.params.hidden)

    def batches(self, shard: Shard) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mine = torch.tensor(shard_indices(self.train_size, shard), dtype=torch.long)
        if len(mine) == 0:
            raise ValueError(f"shard {shard.index} of {shard.count} has no digits (the training set has "
                             f"{self.train_size})")
        x, y = self._x_train[mine], self._y_train[mine]
        # Reshuffled every pass, the same sequence for the same job seed and shard.
        rng = np.random.default_rng([self.params.seed, shard.seed % 2**63, shard.index, shard.count])
        while True:
            order = torch.from_numpy(rng.permutation(len(mine)))
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                yield x[idx], y[idx]

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        if device not in self._test_on:
            self._test_on[device] = tuple(t.to(device) for t in self._test_cpu)
        x_test, y_test = self._test_on[device]
        logits = model(x_test).float()
        return {"loss": torch.nn.functional.cross_entropy(logits, y_test).item(),
                "accuracy": (logits.argmax(dim=1) == y_test).float().mean().item()}
