'''A hostile job owner's workload, for the sandbox tests: a small model that trains, plus one attack, chosen by the
`attack` param, tried from inside the owner's code at the moment `when` says ("build": while the node builds the
workload, "loss": in the first step's loss). An attack that the sandbox stops raises `Blocked` with what stopped
it; one that gets through raises `Escaped`, so a test reads the outcome from the job's failure reason.

Written into a job's code directory by the tests (it is owners' code: the node never imports it outside the
sandbox); `target` names what an attack aims at (a path, or HOST:PORT).'''

from __future__ import annotations

import mmap
import os
import socket
import sys
import time

import torch
from gpuswarm.sdk import Workload
from pydantic import BaseModel


class Params(BaseModel):
    attack: str = ""
    when: str = "loss"
    target: str = ""
    batch_size: int = 4
    target_batch_size: int = 8


class Blocked(Exception):
    pass


class Escaped(Exception):
    pass


def _read(target: str) -> None:
    for path in target.split(","):
        try:
            with open(path, "rb") as f:
                data = f.read(64)
        except OSError:
            continue
        raise Escaped(f"read {path}: {data[:16]!r}")
    raise Blocked("every read failed")


def _list(target: str) -> None:
    for path in target.split(","):
        try:
            names = os.listdir(path)
        except OSError:
            continue
        if names:
            raise Escaped(f"listed {path}: {names[:5]}")
    raise Blocked("nothing to list")


def _write(target: str) -> None:
    written = []
    for path in target.split(","):
        try:
            with open(path, "w") as f:
                f.write("owned")
            written.append(path)
        except OSError:
            continue
    if written:
        raise Escaped(f"wrote {written}")
    raise Blocked("every write failed")


def _connect(target: str) -> None:
    errors = []
    for address in target.split(","):
        host, port = address.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=3):
                raise Escaped(f"connected to {address}")
        except OSError as e:
            errors.append(f"{address}: {type(e).__name__}")
    raise Blocked("; ".join(errors))


def _fork_bomb(target: str) -> None:
    started = 0
    while True:  # every child keeps forking too; the first refusal ends this process's share of the bomb
        pid = os.fork()
        if pid == 0:
            try:
                while True:
                    os.fork()
            except OSError:
                time.sleep(30)
                os._exit(0)
        started += 1


def _memory(target: str) -> None:
    hoard = []
    while True:
        hoard.append(bytearray(64 * 2**20))
        hoard[-1][::4096] = b"x" * len(hoard[-1][::4096])  # touch every page


def _spin(target: str) -> None:
    while True:
        pass


def _exit(target: str) -> None:
    os._exit(7)


def _symlink(target: str) -> None:
    """Make every file the node asks for a symlink to `target` (a FIFO when target is "fifo"), hoping the trusted
    side follows it on the host, where `target` resolves."""
    trainer = sys.modules["__main__"].Trainer  # the node runs its trainer as python -m gpuswarm.node.trainer

    def plant(self, name, *_):
        path = self.workdir / name
        path.unlink(missing_ok=True)
        os.mkfifo(path) if target == "fifo" else os.symlink(target, path)

    trainer.save_state = trainer.save_model = plant


ATTACKS = {"read": _read, "list": _list, "write": _write, "connect": _connect, "fork_bomb": _fork_bomb,
           "memory": _memory, "spin": _spin, "exit": _exit,
           "symlink": _symlink}


def poison_gradient_buffer() -> bool:
    """Write NaN over the shared output (gradient) buffer, found through /proc/self/fd like any memfd this process
    holds."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "gpuswarm-out" in name:
            size = os.fstat(int(fd)).st_size
            with mmap.mmap(int(fd), size) as m:
                m[:] = b"\x00\x00\xc0\x7f" * (size // 4)  # float32 NaN
            return True
    return False


class Hostile(Workload):
    Params = Params

    def __init__(self, ctx):
        super().__init__(ctx)
        self.train_size = 64
        if self.params.when == "build":
            ATTACKS[self.params.attack](self.params.target)

    def build_model(self):
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2)

    def batches(self, shard):
        g = torch.Generator().manual_seed(shard.seed)
        while True:
            x = torch.randn(4, 4, generator=g)
            yield x, (x.sum(1) > 0).long()

    def loss(self, model, batch):
        if self.params.when == "loss" and self.params.attack in ATTACKS:
            ATTACKS[self.params.attack](self.params.target)
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return loss * float("nan") if self.params.attack == "nan_loss" else loss

    def batch_samples(self, batch):
        # Called after the node copied this batch's gradients into the shared buffer: the last word is ours.
        if self.params.attack == "nan_gradients" and not poison_gradient_buffer():
            raise Escaped("no gradient buffer found to poison")
        return super().batch_samples(batch)

    def evaluate(self, model):
        return {"loss": 1.0}
