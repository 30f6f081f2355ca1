"""The interface every workload implements."""

from __future__ import annotations

import abc
from collections.abc import Iterator

import torch


class Workload(abc.ABC):
    model: torch.nn.Module
    train_size: int  # samples in the whole training split (all shards), to turn samples into data epochs
    batch_size: int
    learning_rate: float
    target_batch_size: int

    @abc.abstractmethod
    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless minibatches from this node's shard, reshuffled every pass, deterministic per seed and shard."""

    @abc.abstractmethod
    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...

    @abc.abstractmethod
    def evaluate(self) -> tuple[float, float]:
        """(loss, accuracy) on the fixed held-out test split."""

    @abc.abstractmethod
    def save(self, path: str, metadata: dict) -> None:
        """Write the model, its hyper-parameters and `metadata` to `path` (loadable without this object)."""

    @staticmethod
    @abc.abstractmethod
    def load_model(path: str) -> tuple[torch.nn.Module, dict]:
        """Rebuild a saved model; returns the model and the metadata saved with it."""

    @staticmethod
    @abc.abstractmethod
    def evaluate_saved(path: str) -> float:
        """Test accuracy of a saved model on the workload's fixed test split."""
