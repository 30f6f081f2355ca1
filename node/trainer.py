"""The sandboxed half of a job's training: the only process on a node that runs a job's workload code.

Owns building the workload through the SDK (built-in or the owner's code, one path), the device(s) and precision,
the model and its forward/backward passes, this member's stream of batches (`ShardStream`), evaluation, and writing
the model's state when the worker asks. It runs inside the job's bubblewrap sandbox (`gpuswarm.node.sandbox`): no
network, none of the node's state, its own workdir only, limits set by `sandbox.enter` before any workload code is
imported. It holds no key and never talks to the DHT, the coordinator or the daemon: its only link is the socket
to the trusted worker (`gpuswarm.node.worker`, protocol in `gpuswarm.proto.trainer`) and the two shared float32
buffers the worker gave it (`gpuswarm.node.channel.SharedTensor`): parameters in; out, a batch's gradients (mode
"sync") or its parameters after a run of inner steps (modes "diloco" and "fedavg", in which this process also
steps the workload's own optimizer, on the job's device, and keeps its state across rounds).

Run by the worker as: python -m gpuswarm.node.trainer --channel-fd FD [--limits JSON] [--uid UID]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from gpuswarm.node.channel import Channel, ChannelClosed, SharedTensor

WORKLOAD_FAILED = 3  # exit code: the workload failed (its reason went to the worker as a Failed message)
logger = logging.getLogger("gpuswarm.trainer")


def configure_torch(threads: int) -> bool:
    """How a process that trains computes on the CPU: `threads` intra-op threads, and subnormal floats flushed to
    zero (FTZ/DAZ). x86 CPUs take a slow path, up to a hundred times slower, for every operation on a subnormal,
    and training makes them: tinylm's step under one thread cost 0.24 s at the start and 0.47 s after 100 steps
    (AdamW's moments and the gradients decay into that range), and 0.21-0.27 s throughout with them flushed, on
    the same losses to the third digit. Flushing is what GPUs' fast paths do anyway; a workload that needs IEEE
    subnormals may call torch.set_flush_denormal(False) itself. Called before any torch operation: the setting is
    per thread, and the intra-op threads copy it from this one when they start. Returns whether subnormals are
    flushed (not where the CPU cannot: not x86 with SSE3)."""
    import torch

    flushed = torch.set_flush_denormal(True)
    torch.set_num_threads(threads)
    return flushed


def training_devices(precision: str):
    """The devices this trainer may use and whether bf16 autocast is on. Only the job's GPUs are visible in its
    sandbox (none on a CPU node), so every GPU it sees is the job's."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        # Native bf16 only: an emulated one (T4, V100) is slower than fp32.
        bf16 = precision == "bf16" and torch.cuda.is_bf16_supported(including_emulation=False)
        if precision == "bf16" and not bf16:
            logger.warning("bf16 requested but %s does not support it: training in fp32",
                           torch.cuda.get_device_name(0))
    else:
        devices, bf16 = [torch.device("cpu")], False
        if precision == "bf16":
            logger.warning("bf16 requested but this node trains on the CPU: training in fp32")
    return devices, bf16


def _autocast_module():
    import torch

    class Autocast(torch.nn.Module):
        """`model` with bf16 autocast entered inside its own forward (for DataParallel's replica threads)."""

        def __init__(self, model, enabled: bool):
            super().__init__()
            self.model, self.enabled = model, enabled

        def forward(self, *args, **kwargs):
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.enabled):
                return self.model(*args, **kwargs)

    return Autocast


def build_workload(spec, code: Path | None, dataset: Path | None, device, workdir: Path):
    """The job's workload through the SDK, built-in or the owner's: (workload, validated params)."""
    from gpuswarm.node.workloads import resolve_builtin
    from gpuswarm.sdk import Context, Workload
    from gpuswarm.sdk.loader import WorkloadError, import_entrypoint, validate_params

    factory = import_entrypoint(spec.code.entrypoint, code) if spec.code is not None \
        else resolve_builtin(spec.workload)
    params = validate_params(factory, spec.hyperparameters)
    seed = params.get("seed", 0) if isinstance(params, dict) else getattr(params, "seed", 0)
    scratch = workdir / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    ctx = Context(params=params, dataset=dataset, device=device, workdir=scratch, seed=int(seed or 0))
    workload = factory(ctx)
    if not isinstance(workload, Workload):
        raise WorkloadError(f"{spec.label} returned {type(workload).__name__}, not a gpuswarm.sdk.Workload")
    return workload, params


def optimizer_spec(workload):
    """The workload's `OptimizerSpec`, with a clear error for the callable form SDK 1 had before the sandbox."""
    from gpuswarm.proto.trainer import OptimizerSpec
    from gpuswarm.sdk.loader import WorkloadError

    try:
        spec = workload.optimizer()
    except TypeError as e:
        raise WorkloadError(f"Workload.optimizer() takes no arguments and returns a gpuswarm.sdk.OptimizerSpec "
                            f"(the node builds the optimizer from it): {e}") from None
    if not isinstance(spec, OptimizerSpec):
        raise WorkloadError(f"Workload.optimizer() returned {type(spec).__name__}, not a gpuswarm.sdk.OptimizerSpec")
    return spec


@functools.cache
def _metric_names():
    from gpuswarm.proto.models import MetricName
    from pydantic import TypeAdapter

    return TypeAdapter(MetricName)


def clean_metrics(metrics) -> dict[str, float]:
    """The workload's metrics as the wire takes them: named floats, finite, at most 32 (the rest dropped)."""
    if not isinstance(metrics, dict):
        raise TypeError(f"evaluate must return a dict of named metrics, not {type(metrics).__name__}")
    names = _metric_names()
    out: dict[str, float] = {}
    for name, value in metrics.items():
        try:
            names.validate_python(name)
            value = float(value)
        except (ValueError, TypeError):
            logger.warning("ignoring metric %r: not a name and a number", name)
            continue
        if math.isfinite(value) and len(out) < 32:
            out[name] = value
    return out


class ShardStream:
    """The workload's batches for this member's current shard, restarted when the shard changes, with the data
    position (shard and batches taken) that a checkpoint records and a resume skips to."""

    def __init__(self, workload, base_seed: int):
        self.workload, self.base_seed = workload, base_seed
        self.shard = None
        self.taken = 0
        self._it = None

    def reshard(self, index: int, count: int, step: int, resume: dict | None = None) -> bool:
        """Switch to shard `index` of `count` (True if it changed). A resume position for the same shard picks up
        its stream where the checkpoint left it."""
        import itertools

        from gpuswarm.sdk import Shard

        if self.shard is not None and (self.shard.index, self.shard.count) == (index, count):
            return False
        skip = 0
        if resume and (resume.get("index"), resume.get("count")) == (index, count):
            shard, skip = Shard(index, count, int(resume["seed"])), int(resume.get("batches", 0))
        else:  # a new seed per re-sharding: the new stream does not replay the old order
            shard = Shard(index, count, self.base_seed * 1_000_003 + step)
        self.shard, self.taken = shard, skip
        self._it = itertools.islice(iter(self.workload.batches(shard)), skip, None)
        return True

    def next(self):
        batch = next(self._it)
        self.taken += 1
        return batch

    def position(self) -> dict:
        return {"index": self.shard.index, "count": self.shard.count, "seed": self.shard.seed, "batches": self.taken}


class Trainer:
    """The workload and its model, driven one request at a time by the worker."""

    def __init__(self, chan: Channel, start: dict):
        import torch
        from gpuswarm.node.workloads.saved import checkpoint_model_state, load_checkpoint
        from gpuswarm.proto.models import JobSpec

        self.chan = chan
        self.spec = JobSpec.model_validate(start["spec"])
        self.workdir = Path(start["workdir"])
        path = lambda key: Path(start[key]) if start.get(key) else None  # noqa: E731
        self.devices, self.bf16 = training_devices(self.spec.training.precision)
        self.device = self.devices[0]
        self.workload, self.params = build_workload(self.spec, path("code"), path("dataset"), self.device,
                                                    self.workdir)
        model = self.workload.build_model()
        if path("checkpoint") is not None:
            model.load_state_dict(checkpoint_model_state(load_checkpoint(path("checkpoint"))))
        self.model = model.to(self.device)
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.offsets, total = [], 0
        for _, p in self.named:
            self.offsets.append((total, p.numel()))
            total += p.numel()
        self.numel = total
        # Several GPUs given to this job: each local batch is split across them. DataParallel runs the replicas in
        # threads, where the caller's autocast dtype does not reach (they would run fp16): each replica enters bf16
        # autocast itself.
        self.forward_model = torch.nn.DataParallel(_autocast_module()(self.model, self.bf16),
                                                   device_ids=[d.index for d in self.devices]) \
            if len(self.devices) > 1 else self.model
        self.stream = ShardStream(self.workload, self.workload.ctx.seed)
        self.version = 0
        self.params_buf = self.out_buf = None
        self.inner_optimizer = None  # the workload's optimizer over this model (`optimizer`)
        self.round_start = None  # its state dict when the worker's current round started (for the evidence)
        if self.spec.training.mode != "sync":
            # Built now, before the hello: torch's adaptive optimizers import torch._dynamo when the first of them
            # is built (2 CPU-seconds). Built at the first inner step, as it was, that landed in the first round's
            # compute time, which every member's pace for the next round is read from: 0.49 s a step where 0.008
            # was true, so the second round of the digits demo took 21 inner steps instead of 1000.
            self.optimizer()

    def autocast(self):
        import torch

        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def evaluate(self) -> dict[str, float]:
        import torch

        self.model.eval()
        try:
            with torch.no_grad(), self.autocast():
                return clean_metrics(self.workload.evaluate(self.model))
        finally:
            self.model.train()

    def hello(self) -> dict:
        w = self.workload
        return {"kind": "hello", "params": [{"name": n, "shape": list(p.shape)} for n, p in self.named],
                "batch_size": int(w.batch_size), "target_batch_size": int(w.target_batch_size),
                "matchmaking_time": float(w.matchmaking_time), "averaging_timeout": float(w.averaging_timeout),
                "train_size": w.train_size, "optimizer": optimizer_spec(w).model_dump(mode="json"),
                "metrics": self.evaluate(), "devices": [str(d) for d in self.devices], "bf16": self.bf16}

    def map_buffers(self, fds: list[int]) -> None:
        import torch

        if len(fds) != 2:
            raise ChannelClosed(f"expected 2 shared buffers, got {len(fds)}")
        self.params_buf, self.out_buf = SharedTensor(fds[0], self.numel), SharedTensor(fds[1], self.numel)
        with torch.no_grad():
            for (_, p), (o, n) in zip(self.named, self.offsets, strict=True):
                self.params_buf.tensor[o:o + n].copy_(p.detach().reshape(-1))

    def pull_params(self, version: int) -> None:
        """Take the worker's parameters when they changed since the last request."""
        import torch

        if version == self.version:
            return
        with torch.no_grad():
            for (_, p), (o, n) in zip(self.named, self.offsets, strict=True):
                p.copy_(self.params_buf.tensor[o:o + n].view(p.shape))
        self.version = version

    def step(self, request: dict) -> dict:
        import torch
        from gpuswarm.sdk import to_device

        self.stream.reshard(int(request["index"]), int(request["count"]), int(request["step"]), request.get("resume"))
        batch = to_device(self.stream.next(), self.device)
        t0 = time.perf_counter()
        with self.autocast():
            loss = self.workload.loss(self.forward_model, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss.item()}; refusing to share non-finite gradients")
        loss.backward()
        with torch.no_grad():
            for (_, p), (o, n) in zip(self.named, self.offsets, strict=True):
                out = self.out_buf.tensor[o:o + n]
                if p.grad is None:
                    out.zero_()
                else:
                    out.copy_(p.grad.reshape(-1))
                    p.grad = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"kind": "step", "samples": self.workload.batch_samples(batch), "seconds": time.perf_counter() - t0,
                "loss": float(loss.item()), "position": self.stream.position()}

    def optimizer(self):
        if self.inner_optimizer is None:
            self.inner_optimizer = optimizer_spec(self.workload).build([p for _, p in self.named])
        return self.inner_optimizer

    def inner(self, request: dict) -> dict:
        """Up to `steps` steps of the workload's optimizer on this member's batches, stopping early once `seconds`
        have passed; then the parameters into the output buffer. The device is synchronised once, at the end: a
        non-finite loss in any of the steps fails the request there. The first request of a round
        (`round_start`) first keeps a copy of the optimizer's state, on the device, for `save_inner`."""
        import copy

        import torch
        from gpuswarm.sdk import to_device

        self.stream.reshard(int(request["index"]), int(request["count"]), int(request["step"]), request.get("resume"))
        wanted, budget = int(request["steps"]), float(request["seconds"])
        optimizer = self.optimizer()
        if request.get("round_start"):
            self.round_start = copy.deepcopy(optimizer.state_dict())
        t0 = time.perf_counter()
        steps = samples = 0
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        while True:
            batch = self.stream.next()
            samples += self.workload.batch_samples(batch)
            with self.autocast():
                loss = self.workload.loss(self.forward_model, to_device(batch, self.device))
            finite &= torch.isfinite(loss.detach())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps >= wanted or time.perf_counter() - t0 >= budget:
                break
        if not finite.item():
            raise FloatingPointError(f"the training loss was not finite in one of {steps} inner steps")
        with torch.no_grad():
            for (_, p), (o, n) in zip(self.named, self.offsets, strict=True):
                self.out_buf.tensor[o:o + n].copy_(p.detach().reshape(-1))
        return {"kind": "inner", "steps": steps, "samples": samples, "seconds": time.perf_counter() - t0,
                "loss": float(loss.item()), "position": self.stream.position()}

    def save_inner(self, name: str) -> None:
        """The inner optimizer's state at the start of the current round (for the worker's evidence) as a
        torch.save file."""
        import torch

        tmp = self.workdir / (name + ".tmp")
        torch.save(self.round_start if self.round_start is not None else self.optimizer().state_dict(), tmp)
        os.replace(tmp, self.workdir / name)

    def load_inner(self, name: str) -> None:
        """Take an inner optimizer state the worker checked and wrote into this workdir (a referee's replay)."""
        import torch

        path = self.workdir / name
        self.optimizer().load_state_dict(torch.load(path, map_location=self.device, weights_only=True))
        path.unlink()

    def save_state(self, name: str) -> None:
        """The model's state dict (parameters and buffers) on the CPU, for the worker's checkpoint."""
        import torch

        tmp = self.workdir / (name + ".tmp")
        torch.save({k: v.detach().cpu() for k, v in self.model.state_dict().items()}, tmp)
        os.replace(tmp, self.workdir / name)

    def save_model(self, name: str, metrics: dict, metadata: dict) -> None:
        from gpuswarm.node.workloads.saved import save_model_file

        spec = self.spec
        save_model_file(self.workdir / name, workload=spec.workload,
                        entrypoint=spec.code.entrypoint if spec.code else None, params=self.params, model=self.model,
                        metrics=metrics, metadata=metadata)

    def serve(self) -> int:
        self.chan.send(self.hello())
        message, fds = self.chan.recv(max_fds=2)
        self.map_buffers(fds)
        self.chan.send({"kind": "ready"})
        while True:
            request, _ = self.chan.recv()
            op = request.get("op")
            self.pull_params(int(request.get("version", self.version)))
            if op == "step":
                self.chan.send(self.step(request))
            elif op == "inner":
                self.chan.send(self.inner(request))
            elif op in ("save_inner", "load_inner"):
                getattr(self, op)(str(request["name"]))
                self.chan.send({"kind": "saved"})
            elif op == "evaluate":
                self.chan.send({"kind": "metrics", "metrics": self.evaluate()})
            elif op == "save_state":
                self.save_state(str(request["name"]))
                self.chan.send({"kind": "saved"})
            elif op == "save_model":
                self.save_model(str(request["name"]), request["metrics"], request["metadata"])
                self.chan.send({"kind": "saved"})
            elif op == "stop":
                return 0
            else:
                raise ValueError(f"unknown request {op!r}")


def workload_failure(error: BaseException) -> str:
    """A failure's reason for the job's owner: the exception and the innermost frames, owners' code first."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)[-3:]
    where = " < ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(frames))
    # The error last: the coordinator's event keeps a long reason's tail.
    return (f"at {where}: " if where else "") + f"{type(error).__name__}: {error}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuswarm-trainer")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--limits", help="the sandbox's limits (JSON of gpuswarm.node.sandbox.Limits)")
    parser.add_argument("--uid", type=int, help="drop to this uid/gid before any workload code is imported")
    args = parser.parse_args(argv)
    from gpuswarm.node import sandbox
    from gpuswarm.node.worker import die_with_parent

    die_with_parent()  # outside a sandbox (a built-in on a node without bubblewrap); bwrap does it inside one

    limits = sandbox.Limits(**json.loads(args.limits)) if args.limits else None
    if limits is not None or args.uid is not None:
        sandbox.enter(limits or sandbox.Limits(), args.uid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s", stream=sys.stderr)
    chan = Channel.from_fd(args.channel_fd)
    try:
        start, _ = chan.recv()
    except (ChannelClosed, OSError):
        return 0
    configure_torch(int(start.get("threads", 1)))
    os.nice(int(start.get("nice", 0)))
    from gpuswarm.sdk.loader import WorkloadError

    try:
        return Trainer(chan, start).serve()
    except (ChannelClosed, BrokenPipeError, ConnectionResetError):
        return 0  # the worker is gone or ended the session: nothing to tell anyone
    except BaseException as e:  # noqa: BLE001 - the worker gets the reason, whatever the owner's code raised
        reason = str(e) if isinstance(e, WorkloadError) else workload_failure(e)
        logger.error("training failed: %s", reason)
        try:
            from gpuswarm.proto.trainer import MAX_REASON

            chan.send({"kind": "error", "reason": reason[-MAX_REASON:]})
        except OSError:
            pass
        return WORKLOAD_FAILED


if __name__ == "__main__":
    code = main()
    # Out without the interpreter's teardown of torch's modules: 1.1 CPU-seconds on this build, which a node under a
    # CPU quota paid while its daemon uploaded the final model (a lone digits job under 0.4 CPU: 2.3 s from its stop
    # rule to its completion, the trainer's exit using 0.87 CPU-s of the 0.92 there was). Nothing here needs it: the
    # files this process wrote are closed, the worker has taken what it asked for, and the sandbox ends with it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
