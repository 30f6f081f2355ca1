"""The gpuswarm workload: entrypoint `mymodel.workload:MyWorkload`. It wraps the owner's model and Dataset in the
five methods the node calls; everything else (averaging, devices, checkpoints, stopping) is the node's."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from gpuswarm.sdk import Context, Shard, Workload, shard_indices
from pydantic import BaseModel, ConfigDict, Field
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset

from mymodel.data import NpyClassification
from mymodel.model import MyNet


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt param is an error at submit, not a silent default

    hidden: int = Field(64, ge=4, le=4096)
    depth: int = Field(2, ge=0, le=32)
    batch_size: int = Field(32, ge=1, le=4096)
    target_batch_size: int = Field(256, ge=1, le=1_000_000)
    learning_rate: float = Field(3e-3, gt=0, le=1)


class MyWorkload(Workload):
    Params = Params
    params: Params

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if ctx.dataset is None:
            raise ValueError("this job needs its data directory ([dataset] path in job.toml)")
        self.train = NpyClassification(ctx.dataset, "train")
        self.val = NpyClassification(ctx.dataset, "val")
        self.train_size = len(self.train)

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(self.ctx.seed)  # the same initial weights on every member
        return MyNet(features=self.train.features, hidden=self.params.hidden, depth=self.params.depth)

    def batches(self, shard: Shard) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mine = Subset(self.train, list(shard_indices(len(self.train), shard)))
        # Deterministic for this shard, so that the node can resume the stream where it left off.
        generator = torch.Generator().manual_seed((self.ctx.seed * 1_000_003 + shard.seed) * 1_000_003 + shard.index)
        loader = DataLoader(mine, batch_size=self.batch_size, shuffle=True, drop_last=True, generator=generator)
        while True:  # endless: a new shuffle every pass
            yield from loader

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        x, y = self.val.x.to(device), self.val.y.to(device)
        logits = model(x).float()
        return {"loss": F.cross_entropy(logits, y).item(), "accuracy": (logits.argmax(1) == y).float().mean().item()}
