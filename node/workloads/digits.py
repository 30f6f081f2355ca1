"""`digits-mlp`: scikit-learn's bundled 8x8 digits (1,797 images), a fixed 20% test split, an MLP classifier.

The data ship inside scikit-learn, so nothing is downloaded. The test split is fixed (seeded, stratified) so that
every node and every later reader measures accuracy on the same 360 images; node i of n trains on every n-th
training sample, so the shards are disjoint and cover the training set.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gpuswarm.node.workloads.base import Workload
from gpuswarm.proto.workloads import DigitsMLPParams
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SPLIT_SEED = 0
TEST_FRACTION = 0.2


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y)


def build_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


class DigitsMLP(Workload):
    def __init__(self, hyperparameters: dict, *, shard_index: int, num_shards: int):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard {shard_index} is outside 0..{num_shards - 1}")
        self.params = DigitsMLPParams.model_validate(hyperparameters)
        x_train, x_test, y_train, y_test = digits_split()
        self.train_size = len(x_train)
        self.x_shard = torch.from_numpy(x_train[shard_index::num_shards])
        self.y_shard = torch.from_numpy(y_train[shard_index::num_shards]).long()
        self.x_test, self.y_test = torch.from_numpy(x_test), torch.from_numpy(y_test).long()
        # Every node starts from the same weights; hivemind keeps them in step from there.
        torch.manual_seed(self.params.seed)
        self.model = build_model(self.params.hidden)
        self.batch_size = self.params.batch_size
        self.learning_rate = self.params.learning_rate
        self.target_batch_size = self.params.target_batch_size
        self._shard_index = shard_index

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.params.seed * 1000 + self._shard_index)
        while True:
            order = torch.randperm(len(self.x_shard), generator=generator)
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                yield self.x_shard[idx], self.y_shard[idx]

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        self.model.eval()
        try:
            logits = self.model(self.x_test)
            loss = torch.nn.functional.cross_entropy(logits, self.y_test).item()
            accuracy = (logits.argmax(dim=1) == self.y_test).float().mean().item()
        finally:
            self.model.train()
        return loss, accuracy

    def save(self, path: str, metadata: dict) -> None:
        torch.save({"workload": "digits-mlp", "hyperparameters": self.params.model_dump(),
                    "state_dict": self.model.state_dict(), "metadata": metadata}, path)

    @staticmethod
    def load_model(path: str) -> tuple[torch.nn.Module, dict]:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        params = DigitsMLPParams.model_validate(saved["hyperparameters"])
        model = build_model(params.hidden)
        model.load_state_dict(saved["state_dict"])
        model.eval()
        return model, saved.get("metadata", {})

    @staticmethod
    def evaluate_saved(path: str) -> float:
        model, _ = DigitsMLP.load_model(path)
        _, x_test, _, y_test = digits_split()
        with torch.no_grad():
            predictions = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
        return float((predictions == y_test).mean())
