"""The protocol between a node's trusted worker and the sandboxed trainer that runs a job's workload.

Owns the messages the trainer (`gpuswarm.node.trainer`, owners' code inside a bubblewrap sandbox) sends the worker
(`gpuswarm.node.worker`) over their private socket, and `OptimizerSpec`, the declarative optimizer a workload
asks for (the worker builds it: a workload's own code never runs in the trusted process). Everything the trainer
sends is untrusted and is validated here, with bounds; the worker's requests to the trainer are plain dicts.

Two ways to train. Mode "sync", one exchange per local step: the worker sends {"op": "step", ...}, the trainer
computes the gradients of one batch into the shared output buffer and answers `StepDone`. Modes "diloco" and
"fedavg", one exchange per many steps: the worker sends {"op": "inner", "steps": N, "seconds": S, ...}, the trainer
takes up to N steps of the workload's own optimizer (at most about S seconds of them), writes its parameters into
the output buffer and answers `InnerDone`. Parameters travel the other way through the shared parameter buffer,
published by the worker when they change (`version`). Pure pydantic; no I/O.
"""

from __future__ import annotations

from typing import Annotated, Literal

from gpuswarm.proto.models import Metrics
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter

MAX_MESSAGE = 1 << 20  # bytes of one framed JSON message
MAX_TENSORS = 20_000  # parameter tensors in one model
MAX_REASON = 4000

Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimizerSpec(_Message):
    """The optimizer the swarm's averaged steps apply, by name: the trusted worker builds it from torch.optim.
    `betas` and `eps` are Adam's and AdamW's; `momentum` and `nesterov` are SGD's."""

    name: Literal["adam", "adamw", "sgd"] = "adam"
    lr: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] = 1e-3
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    eps: Annotated[float, Field(gt=0, le=1)] = 1e-8
    weight_decay: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] = 0.0
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    nesterov: bool = False

    def build(self, params):
        """The torch optimizer over `params` (torch imported here, so the coordinator never needs it)."""
        import torch

        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov,
                                   weight_decay=self.weight_decay)
        cls = torch.optim.AdamW if self.name == "adamw" else torch.optim.Adam
        return cls(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


class ParamInfo(_Message):
    name: Annotated[str, StringConstraints(max_length=256)]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=2**40)]], Field(max_length=8)]


class Position(_Message):
    """Where this member is in its data shard: a checkpoint records it, a resume skips to it."""

    index: Annotated[int, Field(ge=0)]
    count: Annotated[int, Field(ge=1)]
    seed: int
    batches: Annotated[int, Field(ge=0)]


class Hello(_Message):
    """The trainer built the workload and its model: the parameters' layout (the shared buffers follow it, in this
    order, as float32), the swarm settings and the metrics of the initial weights."""

    kind: Literal["hello"]
    params: Annotated[list[ParamInfo], Field(min_length=1, max_length=MAX_TENSORS)]
    batch_size: Annotated[int, Field(ge=1, le=10**7)]
    target_batch_size: Annotated[int, Field(ge=1, le=10**9)]
    matchmaking_time: Annotated[float, Field(gt=0, le=600, allow_inf_nan=False)]
    averaging_timeout: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)]
    train_size: Annotated[int, Field(ge=1)] | None = None
    optimizer: OptimizerSpec
    metrics: Metrics = Field(max_length=32)
    devices: Annotated[list[Annotated[str, StringConstraints(max_length=64)]], Field(max_length=64)]
    bf16: bool = False

    def numel(self) -> int:
        total = 0
        for p in self.params:
            n = 1
            for d in p.shape:
                n *= d
            total += n
        return total


class Ready(_Message):
    """The trainer mapped the shared buffers and wrote its initial parameters into the parameter buffer."""

    kind: Literal["ready"]


class StepDone(_Message):
    """One local batch done: its gradients are in the shared gradient buffer."""

    kind: Literal["step"]
    samples: Annotated[int, Field(ge=1, le=10**7)]
    seconds: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)]
    loss: Finite
    position: Position


class InnerDone(_Message):
    """Inner steps done with the workload's optimizer: the trainer's parameters after them are in the shared output
    buffer. `position` is where the data stream stands after the last of them."""

    kind: Literal["inner"]
    steps: Annotated[int, Field(ge=1, le=10**6)]
    samples: Annotated[int, Field(ge=1, le=10**12)]
    seconds: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)]
    loss: Finite
    position: Position


class Evaluated(_Message):
    kind: Literal["metrics"]
    metrics: Metrics = Field(max_length=32)


class Saved(_Message):
    """The trainer wrote the file it was asked for into its workdir."""

    kind: Literal["saved"]


class Failed(_Message):
    """The workload failed; `reason` is for the job's owner (the exception and where it was raised)."""

    kind: Literal["error"]
    reason: Annotated[str, StringConstraints(max_length=MAX_REASON)]


TrainerMessage = Annotated[Hello | Ready | StepDone | InnerDone | Evaluated | Saved | Failed,
                           Field(discriminator="kind")]
TRAINER_MESSAGE = TypeAdapter(TrainerMessage)

__all__ = ["MAX_MESSAGE", "TRAINER_MESSAGE", "Evaluated", "Failed", "Hello", "InnerDone", "OptimizerSpec",
           "ParamInfo", "Position", "Ready", "Saved", "StepDone", "TrainerMessage"]
