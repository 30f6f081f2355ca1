"""Workload implementations run by the node's training process, one module per entry in proto's catalogue.

A workload builds the model, the node's deterministic training shard, and the fixed held-out test split. It
knows nothing of hivemind, the daemon or the coordinator; `gpuswarm.node.worker` drives it.
"""

from __future__ import annotations

from gpuswarm.node.workloads.base import Workload
from gpuswarm.node.workloads.digits import DigitsMLP

IMPLEMENTATIONS: dict[str, type[Workload]] = {"digits-mlp": DigitsMLP}


def build_workload(name: str, hyperparameters: dict, shard_index: int, num_shards: int) -> Workload:
    try:
        cls = IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"this node does not implement workload {name!r}") from None
    return cls(hyperparameters, shard_index=shard_index, num_shards=num_shards)
