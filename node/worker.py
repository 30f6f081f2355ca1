"""The training process: one per job on a node, started and supervised by `gpuswarm.node.runner`.

Owns the hivemind DHT peer and `hivemind.Optimizer` of one job run, and driving the job's workload through the
SDK (`gpuswarm.sdk`, built-in or the owner's code, one path): the device(s) and precision, this member's data shard
(by its place among the run's live members, re-sharded when they change), the training loop, evaluation against the
stop rule, checkpoints (written by the member at place 0, uploaded by the daemon), resuming from one, and saving
the final model. A failure in the workload ends the process with an "error" event that names the reason.

It talks to its parent only through JSON lines on stdout (prefixed with `EVENT_PREFIX`, so stray prints cannot be
mistaken for events) and its exit code; it never talks to the coordinator, so training goes on while the
coordinator is down. Crashes here cannot take the daemon down.

Contribution accounting is peer-attested (`gpuswarm.node.attest`): in every gradient all-reduce round the node
shares a claim signed with the daemon's key (`--key`, the daemon's identity file) through the averager's gather
data, and emits one "round" event per round with the signed claims of its whole group, its own first. The daemon
turns that into a RoundReport. A round that failed gives a "round_failed" event, which only the daemon's metrics
count.

Test-only fault injection: GPUSWARM_FAULT_INFLATE_CLAIMS=<factor> multiplies the samples and compute seconds in this
node's OWN claims (those it shares and those it reports), to play a lying node in end-to-end tests of the ledger.
Never set it in production; the worker logs a warning when it is set.

Run as: python -m gpuswarm.node.worker ASSIGNMENT_JSON --host ADDRESS --workdir DIR --key IDENTITY_KEY
        [--code DIR_OR_WHEEL] [--dataset PATH] [--checkpoint FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

from gpuswarm.proto import logs

EVENT_PREFIX = "@gpuswarm "
PARENT_PID_ENV = "GPUSWARM_PARENT_PID"
PR_SET_PDEATHSIG = 1
RENDEZVOUS_TIMEOUT = 60.0
MEMBER_TTL = 20.0  # a member's record in the run's membership key lives this long unless refreshed
MEMBER_REFRESH = 5.0
CHECKPOINT_FORMAT = "gpuswarm-checkpoint/1"
WORKLOAD_FAILED = 3  # exit code: the job's workload failed (its reason went out as an "error" event)
FAULT_INFLATE_ENV = "GPUSWARM_FAULT_INFLATE_CLAIMS"
logger = logging.getLogger("gpuswarm.worker")


def emit(event: str, **fields) -> None:
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event, **fields}, allow_nan=False) + "\n")
    sys.stdout.flush()


def claim_inflation() -> float:
    """The test-only fault injection factor (GPUSWARM_FAULT_INFLATE_CLAIMS); 1.0 when unset."""
    raw = os.environ.get(FAULT_INFLATE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        factor = float(raw)
    except ValueError:
        factor = math.nan
    if not (math.isfinite(factor) and factor > 0):
        raise SystemExit(f"{FAULT_INFLATE_ENV} must be a positive number, not {raw!r}")
    logger.warning("FAULT INJECTION (tests only): this node inflates its own claims by %g", factor)
    return factor


def load_identity(path: Path):
    """The daemon's signing key. Only an existing key file is accepted: the training process never makes one."""
    from gpuswarm.node.identity import KEY_FILE, load_or_create

    if path.name != KEY_FILE or not path.is_file():
        raise SystemExit(f"--key must name the node's existing {KEY_FILE}, not {path}")
    return load_or_create(path.parent)


class Membership:
    """This member's record in the run's membership key, and its place among the run's live members.

    Each member refreshes its own record (a short TTL), so a member that died drops out within `MEMBER_TTL`. The
    sorted live node ids give every member its place, hence its data shard; the shards change when members come
    and go. After the rendezvous a helper thread does the DHT calls and keeps the place current, so the training
    thread never waits on the DHT for it (a slow lookup would hold this member back in every round)."""

    def __init__(self, dht, run_id: str, node_id: str):
        self.dht, self.key, self.node_id = dht, f"{run_id}.members", node_id
        self._place = (0, 1)

    def refresh(self) -> None:
        from hivemind.utils import get_dht_time

        self.dht.store(self.key, subkey=self.node_id, value=time.time(), expiration_time=get_dht_time() + MEMBER_TTL)

    def members(self) -> list[str]:
        found = self.dht.get(self.key, latest=True)
        ids = set(found.value) if found is not None and isinstance(found.value, dict) else set()
        return sorted({str(i) for i in ids} | {self.node_id})

    def look(self) -> tuple[int, int]:
        members = self.members()
        self._place = (members.index(self.node_id), len(members))
        return self._place

    def place(self) -> tuple[int, int]:
        """(index, count): this member's place among the live members, as last seen."""
        return self._place

    def wait_for(self, min_nodes: int, stop: threading.Event) -> None:
        """Hold training until `min_nodes` members have checked in, so a fast first node does not finish the job
        alone before its peers arrive. A node joining a run in progress finds the others and goes straight on (and
        then loads the current state from a peer)."""
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT
        refreshed, count = 0.0, 0
        while not stop.is_set() and time.monotonic() < deadline:
            if time.monotonic() - refreshed >= MEMBER_REFRESH:
                self.refresh()
                refreshed = time.monotonic()
            count = self.look()[1]
            if count >= min_nodes:
                emit("members", count=count)
                return
            time.sleep(0.5)
        logger.warning("only %d of %d members arrived within %.0fs; training anyway", count, min_nodes,
                       RENDEZVOUS_TIMEOUT)

    def keep_fresh(self, stop: threading.Event) -> threading.Thread:
        """Refresh this member's record and its place from a thread until `stop`."""
        def loop() -> None:
            while not stop.wait(MEMBER_REFRESH):
                try:
                    self.refresh()
                    self.look()
                except Exception as e:  # noqa: BLE001 - a DHT hiccup; the next round tries again
                    logger.debug("membership refresh failed: %r", e)

        thread = threading.Thread(target=loop, name="membership", daemon=True)
        thread.start()
        return thread


def wait_for_tracker(optimizer, min_nodes: int, stop: threading.Event) -> None:
    """After the first local step, hold training until hivemind's progress tracker sees `min_nodes` peers.

    A node that trains before its tracker has seen the others believes it is alone and races through epochs on
    its own, scheduling and cancelling averaging rounds in quick succession; in hivemind 1.1.12 that can leave the
    matchmaker wedged ("another look_for_group is already in progress"), and every later round then fails. The
    tracker publishes a peer only once it has accumulated samples, hence one step first."""
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT
    while not stop.is_set() and time.monotonic() < deadline:
        if optimizer.tracker.global_progress.num_peers >= min_nodes:
            return
        time.sleep(0.2)
    logger.warning("the progress tracker saw %d of %d peers; training anyway",
                   optimizer.tracker.global_progress.num_peers, min_nodes)


def training_devices(precision: str):
    """The devices this training process may use and whether bf16 autocast is on. The runner sets
    CUDA_VISIBLE_DEVICES to the GPUs the node gave this job (none on a CPU node), so every visible GPU is ours."""
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


def stop_reason(rule, metrics: dict[str, float], step: int, epochs: float | None, elapsed: float) -> str | None:
    """Why training stops now, or None: the first rule of `rule` (a proto StopRule) that is met."""
    for name, op, threshold in rule.metric_targets():
        value = metrics.get(name)
        if value is not None and (value <= threshold if op == "<=" else value >= threshold):
            return f"{name} {value:.4g} {op} {threshold:g}"
    if rule.max_steps is not None and step >= rule.max_steps:
        return f"reached max_steps {rule.max_steps}"
    if rule.max_epochs is not None and epochs is not None and epochs >= rule.max_epochs:
        return f"reached max_epochs {rule.max_epochs}"
    if rule.max_seconds is not None and elapsed >= rule.max_seconds:
        return f"reached max_seconds {rule.max_seconds:g}"
    return None


def check_stop_rule(rule, metrics: dict[str, float], train_size: int | None) -> None:
    """Refuse a stop rule the workload cannot meet: a metric it does not report, or only epochs it cannot count."""
    from gpuswarm.sdk.loader import WorkloadError

    for name, _, _ in rule.metric_targets():
        if name not in metrics:
            raise WorkloadError(f"the stop rule names metric {name!r} but the workload reports: "
                                f"{', '.join(sorted(metrics)) or 'nothing'}")
    if train_size is None and rule.max_epochs is not None and not (
            rule.metric_targets() or rule.max_steps or rule.max_seconds):
        raise WorkloadError("the stop rule can only end on max_epochs, but the workload does not know its "
                            "train_size; add max_steps, max_seconds or a metric target")


class Checkpoints:
    """When this member writes a checkpoint, and writing it: model, optimizer state (hivemind's, with the epoch),
    global step and data position. Only the member at place 0 writes; the daemon uploads the file."""

    def __init__(self, options, directory: Path):
        self.every_steps = options.checkpoint_every_steps
        self.every_seconds = options.checkpoint_every_minutes * 60 if options.checkpoint_every_minutes else None
        self.directory = directory
        self.last_step, self.last_time = None, time.monotonic()

    def due(self, step: int) -> bool:
        if self.last_step is None:
            self.last_step = step  # counting starts at this process's first step
            return False
        if step <= self.last_step:
            return False
        by_steps = self.every_steps is not None and step - self.last_step >= self.every_steps
        by_time = self.every_seconds is not None and time.monotonic() - self.last_time >= self.every_seconds
        return by_steps or by_time

    def write(self, model, optimizer, step: int, samples: int, position: dict) -> Path:
        import torch

        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"checkpoint-{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"format": CHECKPOINT_FORMAT, "step": step, "samples": samples, "data_position": position,
                    "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                    "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, path)
        self.last_step, self.last_time = step, time.monotonic()
        return path


def load_checkpoint(path: Path) -> dict:
    import torch

    # weights_only: a checkpoint was written by another node, and a pickle could run code here.
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path.name} is not a gpuswarm checkpoint")
    return saved


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


def run(assignment: dict, host: str, workdir: Path, stop: threading.Event, key_path: Path,
        code: Path | None = None, dataset: Path | None = None, checkpoint: Path | None = None) -> int:
    import hivemind
    import torch
    from gpuswarm.dht.swarm import SwarmDHT
    from gpuswarm.dht.validators import NodeAdvertValidator
    from gpuswarm.node.attest import ClaimAttestor, RoundResult
    from gpuswarm.node.workloads.saved import save_model_file
    from gpuswarm.proto.models import Assignment
    from gpuswarm.sdk import to_device

    torch.set_num_threads(int(os.environ.get("GPUSWARM_TORCH_THREADS", "1")))
    a = Assignment.model_validate(assignment)
    identity = load_identity(key_path)
    if identity.node_id != a.node_id:
        raise SystemExit(f"the assignment is for node {a.node_id}, but {key_path} is node {identity.node_id}'s key")
    inflate = claim_inflation()
    spec = a.spec
    devices, bf16 = training_devices(spec.training.precision)
    Autocast = _autocast_module()  # noqa: N806 - a class
    device = devices[0]
    workload, params = build_workload(spec, code, dataset, device, workdir)
    model = workload.build_model()
    resumed = load_checkpoint(checkpoint) if checkpoint is not None else None
    if resumed is not None:
        model.load_state_dict(resumed["model"])
    model.to(device)

    def autocast():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16)

    def evaluate() -> dict[str, float]:
        model.eval()
        try:
            with torch.no_grad(), autocast():
                return clean_metrics(workload.evaluate(model))
        finally:
            model.train()

    # Before joining anyone: a stop rule the workload cannot meet fails here, in seconds, with the reason.
    check_stop_rule(spec.stop, evaluate(), workload.train_size)
    # Several GPUs given to this job: each local batch is split across them (the node's share, on all its GPUs).
    # DataParallel runs the replicas in threads, where the caller's autocast dtype does not reach (they would run
    # fp16): each replica enters bf16 autocast itself.
    forward_model = torch.nn.DataParallel(Autocast(model, bf16), device_ids=[d.index for d in devices]) \
        if len(devices) > 1 else model
    logger.info("training %s on %s%s", spec.label, ", ".join(str(d) for d in devices), " (bf16 autocast)" if bf16
                else "")

    def report_round(result: RoundResult) -> None:
        emit("round", job_id=a.job_id, epoch=result.epoch, solo=result.solo, claims=result.claims)

    def report_failed_round(epoch: int, error: BaseException) -> None:
        # For the daemon's metrics only: hivemind has already fallen back to this node's local gradients.
        emit("round_failed", job_id=a.job_id, epoch=epoch, error=repr(error)[:200])

    dht = SwarmDHT(
        initial_peers=a.initial_peers, host_maddrs=[f"/ip4/{host}/tcp/0"], start=True,
        record_validators=[NodeAdvertValidator()],
    )
    optimizer = attestor = None
    done = threading.Event()  # ends this run's helper threads
    try:
        emit("ready", maddrs=[str(m) for m in dht.get_visible_maddrs()])
        membership = Membership(dht, a.run_id, a.node_id)
        membership.wait_for(spec.min_nodes, stop)
        membership.keep_fresh(done)
        attestor = ClaimAttestor(identity.private_key, a.job_id, str(dht.peer_id), report_round, inflate=inflate,
                                 on_failed=report_failed_round)
        optimizer = hivemind.Optimizer(
            dht=dht, run_id=a.run_id, target_batch_size=workload.target_batch_size,
            batch_size_per_step=workload.batch_size, params=model.parameters(), optimizer=workload.optimizer,
            matchmaking_time=workload.matchmaking_time, averaging_timeout=workload.averaging_timeout,
            # A newcomer joining a run in progress takes the current weights and optimizer state from a peer.
            load_state_timeout=60.0, averager_opts={"request_timeout": 1.0}, verbose=False,
            # Every gradient round carries this node's signed claim as gather data (see gpuswarm.node.attest).
            grad_averager_factory=attestor.averager_factory,
        )
        if resumed is not None:
            # Every member of a run that lost all its nodes resumes from the same checkpoint; a member that finds
            # peers further on loads their state instead (hivemind does, in its first step).
            optimizer.load_state_dict(resumed["optimizer"])
            name = a.checkpoint.name if a.checkpoint is not None else checkpoint.name  # the cache names it by hash
            logger.info("resumed from %s at step %d", name, optimizer.local_epoch)
            emit("resumed", step=optimizer.local_epoch, checkpoint=name)
        attestor.attach(lambda: optimizer.local_epoch)
        # The averager and DHT run in their own processes, already started. Lowering only this process's priority
        # keeps a CPU-bound training loop from starving the all-reduce rounds on a shared CPU (a 2-core host
        # running several nodes would otherwise miss every matchmaking deadline).
        os.nice(int(os.environ.get("GPUSWARM_TRAIN_NICE", "10")))
        stream = ShardStream(workload, workload.ctx.seed)
        stream.reshard(*membership.place(), optimizer.local_epoch, resumed and resumed.get("data_position"))
        checkpoints = Checkpoints(spec.training, workdir / "checkpoints")
        last_epoch = optimizer.local_epoch
        samples_total, started = 0, time.time()
        while not stop.is_set():
            batch = to_device(stream.next(), device)
            t0 = time.perf_counter()
            with autocast():
                loss = workload.loss(forward_model, batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"training loss is {loss.item()}; refusing to share non-finite gradients")
            loss.backward()
            n = workload.batch_samples(batch)
            # Recorded before optimizer.step(): a round scheduled inside that step claims this batch, which
            # hivemind has accumulated by then.
            attestor.meter.record(n, time.perf_counter() - t0)
            first_step = samples_total == 0
            optimizer.step()
            optimizer.zero_grad()
            samples_total += n
            attestor.poll()  # reports the round that just finished, or the epoch this node ended alone
            if first_step:
                # The tracker publishes a peer only once it has accumulated samples: one step first, then wait.
                wait_for_tracker(optimizer, spec.min_nodes, stop)
            if optimizer.local_epoch == last_epoch:
                continue
            last_epoch = step = optimizer.local_epoch
            index, count = membership.place()
            if stream.reshard(index, count, step):
                logger.info("members changed: now shard %d of %d", index, count)
            metrics = evaluate()
            epochs = step * workload.target_batch_size / workload.train_size if workload.train_size else None
            elapsed = max(time.time() - started, 1e-6)
            loss_value = metrics.get("loss", metrics.get("val_loss"))
            accuracy = metrics.get("accuracy")
            emit("progress", job_id=a.job_id, epoch=round(epochs or 0.0, 3), global_step=step,
                 samples=samples_total, loss=round(loss_value, 5) if loss_value is not None and loss_value >= 0
                 else None, accuracy=round(accuracy, 5) if accuracy is not None and 0 <= accuracy <= 1 else None,
                 samples_per_second=round(samples_total / elapsed, 2), metrics=metrics,
                 peers=optimizer.tracker.global_progress.num_peers)
            reason = stop_reason(spec.stop, metrics, step, epochs, elapsed)
            if reason is not None:
                path = workdir / "model.pt"
                save_model_file(path, workload=spec.workload, entrypoint=spec.code.entrypoint if spec.code else None,
                                params=params, model=model, metrics=metrics,
                                metadata={"job_id": a.job_id, "global_step": step, "epoch": epochs,
                                          "accuracy": accuracy, "stopped": reason})
                logger.info("stop rule met: %s", reason)
                emit("finished", path=str(path), accuracy=accuracy if accuracy is not None and 0 <= accuracy <= 1
                     else None, epoch=round(epochs or 0.0, 3), global_step=step, metrics=metrics, reason=reason)
                return 0
            if index == 0 and checkpoints.due(step):
                path = checkpoints.write(model, optimizer, step, samples_total, stream.position())
                emit("checkpoint", path=str(path), step=step)
        return 0
    finally:
        done.set()
        if optimizer is not None:
            optimizer.shutdown()
        if attestor is not None and optimizer is not None:
            # Rounds that finished while the optimizer shut down (it tags along with a running round) still count.
            # Work since the last round was never averaged into the model, so it is not claimed.
            attestor.finish()
        dht.shutdown()


def die_with_parent() -> None:
    """Get SIGTERM when the daemon dies (PR_SET_PDEATHSIG), so no job trains unaccounted after a daemon crash;
    exit at once if it already died before this call."""
    import ctypes

    parent = int(os.environ.get(PARENT_PID_ENV, "0"))
    if not parent:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        sys.exit("the node daemon that started this training process is gone")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuswarm-worker")
    parser.add_argument("assignment", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--key", type=Path, required=True,
                        help="the daemon's Ed25519 identity file (<state_dir>/identity.key); signs the claims")
    parser.add_argument("--code", type=Path, help="the job's code: an unpacked directory or a wheel")
    parser.add_argument("--dataset", type=Path, help="the job's dataset: a file or an unpacked directory")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint to resume from when no peer has the state")
    args = parser.parse_args(argv)
    die_with_parent()
    logs.configure("info", os.environ.get(logs.FORMAT_ENV, "text"), "worker")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    assignment = json.loads(args.assignment.read_text())
    from gpuswarm.sdk.loader import WorkloadError

    try:
        return run(assignment, args.host, args.workdir, stop, args.key, args.code, args.dataset, args.checkpoint)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the daemon gets the reason, whatever the owner's code raised
        reason = str(e) if isinstance(e, WorkloadError) else workload_failure(e)
        logger.error("training failed: %s", reason)
        emit("error", reason=reason)
        return WORKLOAD_FAILED


def workload_failure(error: BaseException) -> str:
    """A failure's reason for the job's owner: the exception and the innermost frames, owners' code first."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)[-3:]
    where = " < ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(frames))
    # The error last: the coordinator's event keeps a long reason's tail.
    return (f"at {where}: " if where else "") + f"{type(error).__name__}: {error}"


if __name__ == "__main__":
    sys.exit(main())
