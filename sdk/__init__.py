"""The workload SDK: the one interface between training code and a gpuswarm node. Import path: `gpuswarm.sdk`.

A workload says what to train; the node decides how (hivemind averaging, devices, precision, checkpoints,
sharding, stop rules). Job owners' own code and the built-in workloads implement the same `Workload` class, and
the node's training process drives both the same way. docs/workloads.md is the guide; this module is the
contract, and it stays backward compatible within a major version (`SDK_VERSION`).

A job's entrypoint (`package.module:function` in its job file) names a factory: `function(ctx: Context) ->
Workload`. A `Workload` subclass itself is such a factory.

Owns: `Context`, `Shard`, `Workload` and the small helpers workloads share (`shard_indices`, `to_device`);
re-exports `OptimizerSpec` (defined with the node's trainer protocol, `gpuswarm.proto.trainer`). It imports torch,
pydantic and that protocol only; nothing here touches the network, the DHT or the node's state. A workload runs in
a sandbox on the node (no network, no node state, its own workdir): docs/security.md says what it can reach.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from gpuswarm.proto.trainer import OptimizerSpec
from pydantic import BaseModel

SDK_VERSION = 1

Batch = Any  # a tensor, or a tuple/list/dict of tensors: whatever `loss` takes


@dataclass(frozen=True)
class Shard:
    """This member's share of the training data: the `index`-th of `count` disjoint parts. The node derives it
    from the member's place among the run's current members, so it changes when members join or leave; `seed`
    changes with it, so that a re-sharded stream does not replay the order it had before."""

    index: int
    count: int
    seed: int

    def __post_init__(self) -> None:
        if not (self.count >= 1 and 0 <= self.index < self.count):
            raise ValueError(f"shard {self.index} of {self.count} does not exist")


@dataclass
class Context:
    """What the node tells a workload when it builds it."""

    params: Any  # the workload's `Params` instance when it declares one, else the job's params as a dict
    dataset: Path | None  # the job's dataset: the file itself, or the unpacked directory; None if the job has none
    device: torch.device  # where the node trains; the model and batches are moved there by the node
    workdir: Path  # scratch space for this job on this node (caches, unpacked files)
    seed: int = 0  # the job's seed: every member builds the same initial weights from it
    extra: dict[str, Any] = field(default_factory=dict)  # node facts for the curious (gpu names, member count)


def shard_indices(n: int, shard: Shard) -> range:
    """Indices of `n` samples that belong to `shard`: every `count`-th, starting at `index` (disjoint, covering)."""
    return range(shard.index, n, shard.count)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` with every tensor in it moved to `device` (tuples, lists and dicts are walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class Workload(abc.ABC):
    """Subclass this. The node calls, in order: `build_model` once, `batches` for each shard it is given, `loss`
    for every batch (it does backward and the optimizer step itself), and `evaluate` after every averaged step.

    Class attributes a workload may set:
    - `Params`: a pydantic model of the job's params. `gpuswarm job submit` checks the params against it, and the
      node again; the workload then reads `self.params` as an instance of it. Without it, params are a dict.
    - `train_size`: samples in one pass over the whole training set (all shards), if known: `stop.max_epochs`
      and the epoch shown in `job status` need it.

    Swarm settings read from the params when they have fields of these names, else the defaults below:
    `batch_size` (samples per local step), `target_batch_size` (samples the swarm accumulates per averaged step),
    `learning_rate`, `matchmaking_time` and `averaging_timeout` (seconds, hivemind's)."""

    Params: ClassVar[type[BaseModel] | None] = None
    train_size: int | None = None

    batch_size: int = 32
    target_batch_size: int = 256
    learning_rate: float = 1e-3
    matchmaking_time: float = 3.0
    averaging_timeout: float = 10.0

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.params = ctx.params
        for name in ("batch_size", "target_batch_size", "learning_rate", "matchmaking_time", "averaging_timeout"):
            value = ctx.params.get(name) if isinstance(ctx.params, dict) else getattr(ctx.params, name, None)
            if value is not None:
                setattr(self, name, value)

    @abc.abstractmethod
    def build_model(self) -> torch.nn.Module:
        """The model, on the CPU, with the same initial weights on every member (seed from `self.ctx.seed`)."""

    @abc.abstractmethod
    def batches(self, shard: Shard) -> Iterator[Batch]:
        """An endless stream of training batches from `shard` of the dataset, deterministic for a given shard (the
        node resumes a stream by skipping the batches it already took). Tensors on the CPU; the node moves them."""

    @abc.abstractmethod
    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The scalar training loss of `batch` (already on the model's device)."""

    @abc.abstractmethod
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Named metrics on held-out data, e.g. {"loss": 0.3, "accuracy": 0.95}; the job's stop rule may name any
        of them. Called under `torch.no_grad()` with the model in eval mode, on the node's device."""

    def optimizer(self) -> OptimizerSpec:
        """The optimizer that steps the model, by name (default: Adam at `learning_rate`): the node builds it, for
        the local steps of mode "diloco" next to the model on its device, for the averaged steps of mode "sync" in
        its trusted worker. So it is a declaration, not code: Adam, AdamW or SGD with their usual settings
        (`OptimizerSpec`)."""
        return OptimizerSpec(name="adam", lr=self.learning_rate)

    def batch_samples(self, batch: Batch) -> int:
        """Samples in `batch` (default: the length of its first tensor): the unit of claims and epochs."""
        first = batch
        while isinstance(first, tuple | list | dict):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        return int(first.shape[0]) if isinstance(first, torch.Tensor) else 1


__all__ = ["SDK_VERSION", "Batch", "Context", "OptimizerSpec", "Shard", "Workload", "shard_indices", "to_device"]
