"""The catalogue of built-in workloads and their hyper-parameter schemas.

The coordinator rejects a job whose workload is not listed here, and normalises its hyper-parameters with the
workload's schema (both through `proto.models.JobSpec`); the node's training process runs each listed workload.
Adding a workload means a schema here and a `gpuswarm.sdk.Workload` subclass, listed in
`gpuswarm.node.workloads.BUILTINS`, whose `Params` is that schema (this module stays free of torch, so the
coordinator and the CLI can import it).
Field names `batch_size`, `target_batch_size`, `learning_rate`, `matchmaking_time` and `averaging_timeout` are the
swarm settings the node reads from any workload's params. Schemas are strict
(`proto.strict.OwnerModel`): an unknown hyper-parameter or a wrong type ("64" for an int) is an error naming it.
"""

from __future__ import annotations

from typing import Annotated, Any

from gpuswarm.proto.strict import OwnerModel
from pydantic import BaseModel, Field


class DigitsMLPParams(OwnerModel):
    """A two-layer perceptron on scikit-learn's 8x8 digits, trained with Adam and hivemind gradient averaging."""

    hidden: Annotated[int, Field(ge=8, le=4096)] = 128
    learning_rate: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.02
    batch_size: Annotated[int, Field(ge=1, le=4096)] = 32
    # Samples the whole swarm accumulates before each averaging round and optimizer step.
    target_batch_size: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    # The initial weights (the same on every member) and, with the node's shard seed, the order of the batches.
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    matchmaking_time: Annotated[float, Field(ge=1.5, le=60, allow_inf_nan=False)] = 3.0
    averaging_timeout: Annotated[float, Field(ge=1, le=600, allow_inf_nan=False)] = 10.0


WORKLOADS: dict[str, type[BaseModel]] = {"digits-mlp": DigitsMLPParams}


def validate_hyperparameters(workload: str, values: dict[str, Any]) -> dict[str, Any]:
    """Return the workload's hyper-parameters with defaults filled in; raise ValueError on unknown or bad ones."""
    schema = WORKLOADS.get(workload)
    if schema is None:
        raise ValueError(f"unknown workload {workload!r}")
    return schema.model_validate(values).model_dump()
