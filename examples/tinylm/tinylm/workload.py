"""The gpuswarm workload of tinylm: entrypoint `tinylm.workload:TinyLM`.

Data: every file under the job's dataset directory, read in sorted order as raw bytes. A file belongs to the
validation set when a hash of its path says so (`val_percent`), so the split does not move when files are added;
the rest, concatenated, is the training stream. The stream is cut into chunks of `chunk` bytes and shard i of n
owns every n-th chunk; a batch is `batch_size` windows of `context + 1` bytes at random places inside the shard's
chunks, so two shards never read the same bytes. Evaluation is the mean next-byte loss on `val_windows` fixed,
evenly spaced windows of the validation set: {"val_loss" (nats per byte), "val_bpb" (bits per byte)}.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from gpuswarm.sdk import Context, OptimizerSpec, Shard, Workload, shard_indices
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.nn import functional as F

from tinylm.model import TinyGPT


class Params(BaseModel):
    """tinylm's params (the job file's [params]); unknown names are refused."""

    model_config = ConfigDict(extra="forbid")

    # The model: 1.4 M parameters by default.
    context: Annotated[int, Field(ge=8, le=4096)] = 64
    d_model: Annotated[int, Field(ge=16, le=4096)] = 192
    n_layer: Annotated[int, Field(ge=1, le=64)] = 3
    n_head: Annotated[int, Field(ge=1, le=64)] = 6
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    # Training: the swarm settings the node reads, and AdamW's.
    batch_size: Annotated[int, Field(ge=1, le=4096)] = 16
    target_batch_size: Annotated[int, Field(ge=1, le=10**7)] = 64
    learning_rate: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 5e-3
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.01
    matchmaking_time: Annotated[float, Field(ge=1, le=60)] = 3.0
    averaging_timeout: Annotated[float, Field(ge=1, le=600)] = 10.0
    # Data.
    val_percent: Annotated[float, Field(gt=0, lt=50)] = 5.0
    val_windows: Annotated[int, Field(ge=1, le=100_000)] = 32
    chunk: Annotated[int, Field(ge=64, le=2**24)] = 4096  # bytes per shard unit; windows never cross chunks

    @model_validator(mode="after")
    def _fits(self) -> Params:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        if self.chunk < 2 * (self.context + 1):
            raise ValueError(f"chunk ({self.chunk}) must hold at least two windows of context + 1 bytes")
        return self


def read_corpus(root: Path, val_percent: float) -> tuple[bytes, bytes]:
    """(train, validation) bytes of every file under `root`, in sorted path order, split by file."""
    if root.is_file():
        files = [(root.name, root)]
    else:
        files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"the dataset {root} has no files")
    train, val = [], []
    for rel, path in files:
        is_val = zlib.crc32(rel.encode()) % 10_000 < val_percent * 100
        (val if is_val else train).append(path.read_bytes())
    if not val or not train:  # too few files for the hash to pick both: the last tenth of the bytes validates
        data = b"".join(train + val)
        cut = len(data) - len(data) // 10
        return data[:cut], data[cut:]
    return b"".join(train), b"".join(val)


class TinyLM(Workload):
    Params = Params
    params: Params

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if ctx.dataset is None:
            raise ValueError("tinylm needs a dataset: a directory of text files ([dataset] in the job file)")
        p = self.params
        train, val = read_corpus(Path(ctx.dataset), p.val_percent)
        n_chunks = len(train) // p.chunk
        if n_chunks < 1:
            raise ValueError(f"the training text is {len(train)} bytes, less than one chunk of {p.chunk}")
        self._chunks = torch.frombuffer(bytearray(train[: n_chunks * p.chunk]), dtype=torch.uint8).view(n_chunks,
                                                                                                         p.chunk)
        window = p.context + 1
        if len(val) < window:
            raise ValueError(f"the validation text is {len(val)} bytes, less than one window of {window}")
        starts = np.linspace(0, len(val) - window, num=p.val_windows).astype(np.int64)
        val_bytes = torch.frombuffer(bytearray(val), dtype=torch.uint8)
        self._val_cpu = torch.stack([val_bytes[s : s + window] for s in starts.tolist()])
        self._val_on: dict[torch.device, torch.Tensor] = {}
        self.train_size = n_chunks * p.chunk // p.context  # windows per pass over the training text

    def build_model(self) -> torch.nn.Module:
        p = self.params
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.ctx.seed)
            return TinyGPT(context=p.context, d_model=p.d_model, n_layer=p.n_layer, n_head=p.n_head,
                           dropout=p.dropout)

    def batches(self, shard: Shard) -> Iterator[torch.Tensor]:
        mine = self._chunks[torch.tensor(shard_indices(len(self._chunks), shard), dtype=torch.long)]
        if len(mine) == 0:
            raise ValueError(f"shard {shard.index} of {shard.count} gets none of the {len(self._chunks)} chunks of "
                             f"training text; use a smaller chunk or more data")
        window = self.params.context + 1
        offsets = torch.arange(window)
        rng = np.random.default_rng([self.ctx.seed % 2**63, shard.seed % 2**63, shard.index, shard.count])
        while True:
            rows = torch.from_numpy(rng.integers(0, len(mine), size=self.batch_size))
            starts = torch.from_numpy(rng.integers(0, self.params.chunk - window + 1, size=self.batch_size))
            yield mine[rows[:, None], starts[:, None] + offsets]  # (batch, context + 1) bytes

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        tokens = batch.long()
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        if device not in self._val_on:
            self._val_on[device] = self._val_cpu.to(device)
        windows = self._val_on[device]
        total = 0.0
        for start in range(0, len(windows), 64):
            total += self.loss(model, windows[start : start + 64]).item() * len(windows[start : start + 64])
        val_loss = total / len(windows)
        return {"val_loss": val_loss, "val_bpb": val_loss / math.log(2)}

    def optimizer(self) -> OptimizerSpec:
        return OptimizerSpec(name="adamw", lr=self.learning_rate, betas=(0.9, 0.95),
                             weight_decay=self.params.weight_decay)
