"""`digits-mlp`: scikit-learn's bundled 8x8 digits (1,797 images), a fixed 20% test split, an MLP classifier.

The data ship inside scikit-learn, so nothing is downloaded; they are read from its package directory without
importing scikit-learn, which with scipy cost 2 CPU-seconds at every trainer's start (a third of its imports). The
test split is this module's own (`stratified_split`, seeded), so every node and every later reader measures
accuracy on the same 360 images whatever scikit-learn version each has; shard i of n trains on every n-th training
sample (`gpuswarm.sdk.shard_indices`), so the shards are disjoint and cover the training set.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import torch
from gpuswarm.proto.workloads import DigitsMLPParams
from gpuswarm.sdk import Context, Shard, Workload, shard_indices

SPLIT_SEED = 0
TEST_FRACTION = 0.2


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images as 64 pixels of 0..16, labels) from the CSV that scikit-learn ships (what its `load_digits` reads),
    found by the package's location alone: nothing of scikit-learn runs."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("digits-mlp reads its data from scikit-learn's package, which is not installed "
                           "(pip install scikit-learn)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices: ceil(test_fraction * n) for the test split, each label's share of it in proportion
    to the label's count (largest remainders first, then the smaller label), each label's images in a seeded
    random order; both splits then shuffled. The same labels and seed always give the same split."""
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    n_test = math.ceil(test_fraction * len(labels))
    exact = counts * n_test / len(labels)
    shares = np.floor(exact).astype(np.int64)
    shares[np.argsort(-(exact - shares), kind="stable")[:n_test - shares.sum()]] += 1
    train, test = [], []
    for label, share in zip(classes, shares, strict=True):
        mine = rng.permutation(np.flatnonzero(labels == label))
        test.append(mine[:share])
        train.append(mine[share:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


@cache
def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, x_test, y_train, y_test): the fixed split every node and every reader uses. Read-only arrays."""
    x, y = bundled_digits()
    x = (x / 16.0).astype(np.float32)
    train, test = stratified_split(y, TEST_FRACTION, SPLIT_SEED)
    parts = x[train], x[test], y[train], y[test]
    for part in parts:
        part.setflags(write=False)
    return parts


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
                # Counted, then divided in Python: a float32 mean made 342 of 360 right 0.94999999, short of 0.95.
                "accuracy": (logits.argmax(dim=1) == y_test).sum().item() / len(y_test)}
