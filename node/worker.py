"""The trusted half of a job's training: one process per job on a node, started and supervised by
`gpuswarm.node.runner`.

Owns everything of a job run that touches the network and the money: the hivemind DHT peer, `hivemind.Optimizer`
(the averaging and the optimizer step, over the worker's own copy of the parameters), the run's membership and this
member's data shard, the stop rule, checkpoints (written by the member at place 0, uploaded by the daemon) and
resuming from one, the progress events and the claims. The job's workload code never runs here: it runs in the
sandboxed trainer (`gpuswarm.node.trainer`, reached through `gpuswarm.node.trainer_link`). In mode "sync" the
trainer computes each batch's gradients into a shared buffer; the worker copies them out, refuses non-finite ones
and steps. In modes "diloco" and "fedavg" the trainer takes the inner steps itself (the workload's optimizer, on
the job's device) and hands its parameters over every few seconds; the worker copies them out, refuses non-finite
ones and gives hivemind the pseudo-gradient (`gpuswarm.node.local_updates`). Either way the worker publishes the
swarm's parameters back when they change. Whatever the trainer does ends, at worst, as an "error" event with a
reason.

It talks to its parent only through JSON lines on stdout (prefixed with `EVENT_PREFIX`) and stdin (the daemon's
answers to "sign" requests), and its exit code; it never talks to the coordinator, so training goes on while the
coordinator is down. Crashes here cannot take the daemon down.

Contribution accounting is peer-attested (`gpuswarm.node.attest`): in every gradient all-reduce round the node
shares a signed claim through the averager's gather data, and emits one "round" event per round with the signed
claims of its whole group, its own first. This process holds no key: the daemon signs each claim on request
(`DaemonSigner`, after checking it is this node's claim for this job). A round that failed gives a "round_failed"
event, which only the daemon's metrics count.

The run's membership, this member's shard and the waits that keep members in step are `gpuswarm.node.membership`;
the test-only fault injection (a lying, Byzantine or lazy node) is `gpuswarm.node.faults`.

With `--replay EVIDENCE` the worker trains nothing: it re-computes another node's round for a referee (`referee`).

Every averaging round reduces robustly (`dht.hivemind_adapter.install_robust_reducer`, before the averagers start):
NaN and Inf parts are dropped and each peer's pull is clipped, so one Byzantine peer cannot steer the model; the
peers it clipped are logged, and written to `outliers.jsonl` in the workdir.

Run as: python -m gpuswarm.node.worker ASSIGNMENT_JSON --host ADDRESS --workdir DIR [--code DIR_OR_WHEEL]
        [--dataset PATH] [--checkpoint FILE] [--sandbox | --no-sandbox] [--limits JSON] [--answer-timeout S]
        [--max-hours H] [--hide PATH ...]
or as a spare, warmed up before its job, which then comes as one line on stdin: python -m gpuswarm.node.worker --spare
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import zipfile
from pathlib import Path

from gpuswarm.node.faults import byzantine_fault, claim_inflation, lazy_fault, poison_outgoing_parts
from gpuswarm.node.membership import (
    REFRESH_COMPUTING,
    REFRESH_WAITING,
    ROUND_WAIT,
    Membership,
    RecordProofs,
    leave_last_record,
    wait_for_round,
    wait_for_tracker,
)
from gpuswarm.node.trainer_link import Inputs, Settings, TrainerFailed, TrainerLink
from gpuswarm.proto import logs

EVENT_PREFIX = "@gpuswarm "
PARENT_PID_ENV = "GPUSWARM_PARENT_PID"
THREADS_ENV = "GPUSWARM_TORCH_THREADS"  # torch threads for this job's worker and trainer (set by the runner)
SPARE_FLAG = "--spare"  # the worker's only argument when it starts as a spare (`wait_as_spare`)
# What `run` imports besides torch and hivemind (0.25 CPU-seconds; 0.9 while it pulled in scikit-learn), loaded
# by a spare before its job.
SPARE_IMPORTS = ("gpuswarm.dht.swarm", "gpuswarm.dht.validators", "gpuswarm.node.attest", "gpuswarm.node.evidence",
                 "gpuswarm.node.local_updates", "gpuswarm.node.workloads.saved", "gpuswarm.proto.trainer",
                 "gpuswarm.sdk.loader", "gpuswarm.node.sandbox")
PR_SET_PDEATHSIG = 1
SIGN_TIMEOUT = 10.0  # seconds the daemon has to answer a "sign" request
WORKLOAD_FAILED = 3  # exit code: the job's workload failed (its reason went out as an "error" event)
logger = logging.getLogger("gpuswarm.worker")
_emit_lock = threading.Lock()


def emit(event: str, **fields) -> None:
    line = EVENT_PREFIX + json.dumps({"event": event, **fields}, allow_nan=False) + "\n"
    with _emit_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


class OutlierLog:
    """The peers this node's reducers clipped (`outliers.jsonl`, appended by the averager processes), read a
    whole line at a time from where the previous read stopped."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_peers(self, limit: int = 16) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        peers = set()
        for line in complete.splitlines():
            try:
                peers.add(str(json.loads(line)["peer_id"])[:128])
            except (ValueError, KeyError, TypeError):
                continue
        return sorted(peers)[:limit]


class DaemonSigner:
    """Claims signed by the daemon, which holds the node's key: a "sign" event out on stdout, the envelope back on
    stdin as one JSON line {"id": N, "envelope": {...}} (or {"id": N, "error": "..."})."""

    def __init__(self, fd: int = 0):
        # A raw (unbuffered, lock-free) file of its own: a thread blocked reading sys.stdin would hold its buffer's
        # lock, and hivemind's forked processes close sys.stdin on start: they would wait for that lock forever.
        self._file = os.fdopen(os.dup(fd), "rb", buffering=0)
        self._ids = itertools.count(1)
        self._waiting: dict[int, list] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="signer", daemon=True).start()

    def _read(self) -> None:
        pending = b""
        while chunk := self._file.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._answer(line)

    def _answer(self, line: bytes) -> None:
        try:
            answer = json.loads(line)
            slot = self._waiting.get(int(answer["id"]))
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring a bad line from the daemon: %.200r", line)
            return
        if slot is not None:
            slot[1] = answer
            slot[0].set()

    def request(self, event: str, **fields) -> dict:
        """Ask the daemon (a "sign" or "bind" event) and wait for its answer; raise when it refuses or is silent."""
        request_id = next(self._ids)
        slot = [threading.Event(), None]
        with self._lock:
            self._waiting[request_id] = slot
        try:
            emit(event, id=request_id, **fields)
            if not slot[0].wait(SIGN_TIMEOUT):
                raise TimeoutError(f"the daemon did not answer {event} request {request_id} within {SIGN_TIMEOUT:.0f}s")
            answer = slot[1]
            if "error" in answer:
                raise ValueError(f"the daemon refused to {event}: {answer['error']}")
            return answer
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)

    def __call__(self, payload: dict):
        from gpuswarm.proto.signing import SignedEnvelope

        return SignedEnvelope.model_validate(self.request("sign", payload=payload)["envelope"])


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

    def write(self, model_file: bytes, optimizer, step: int, samples: int, position: dict) -> Path:
        import torch
        from gpuswarm.node.workloads.saved import CHECKPOINT_FORMAT

        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"checkpoint-{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"format": CHECKPOINT_FORMAT, "step": step, "samples": samples, "data_position": position,
                    "model_file": model_file, "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, path)
        self.last_step, self.last_time = step, time.monotonic()
        return path


class SharedParams:
    """The worker's own copy of the model's parameters (what hivemind averages and steps), and the two shared
    buffers it trades with the trainer: the trainer's output in (a batch's gradients, or its parameters after inner
    steps; copied out, then checked), parameters out (published when they changed, with a new version number the
    trainer's next request carries).

    hivemind gets the parameters as one flat tensor (`flat`); `params` are views of it in the workload's shapes.
    hivemind's all-reduce cuts its parts tensor by tensor, so a model of many small tensors (biases, norms) is
    averaged in many small parts, each reduced on its own: in the lab (4 peers, 0.4 CPU each, 40 ms, fp16, the
    robust reducer) tinylm's 40 tensors took 3.15 s a round against 1.61 s for the same bytes as one tensor."""

    def __init__(self, link):
        import torch

        self.link, self.version = link, 0
        self.shapes = [tuple(p.shape) for p in link.hello.params]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        initial = link.params.tensor.clone()
        if not torch.isfinite(initial).all():
            raise TrainerFailed("the workload's initial parameters are not finite")
        self.flat = torch.nn.Parameter(initial)
        self.params = [chunk.view(shape) for chunk, shape in zip(self.flat.data.split(self.sizes), self.shapes,
                                                                  strict=True)]
        self.grad_flat = torch.zeros(initial.numel())

    def bind_grads(self) -> None:
        """Mode "sync": hivemind reads the batch's gradients straight from the shared copy."""
        self.flat.grad = self.grad_flat

    def take_grads(self) -> None:
        """The batch's gradients, copied out of the shared buffer first (the trainer cannot change them after the
        check), then refused if any is NaN or infinite."""
        import torch

        self.grad_flat.copy_(self.link.out.tensor)
        if not torch.isfinite(self.grad_flat).all():
            raise TrainerFailed("the workload put non-finite values (NaN or inf) in the shared gradient buffer; "
                                "nothing of this batch was shared")

    def take_inner(self, local) -> None:
        """The trainer's parameters after its inner steps, copied out of the shared buffer into `local` (a
        local_updates.LocalUpdates) first, then refused if any is NaN or infinite."""
        import torch

        local.flat.copy_(self.link.out.tensor)
        if not torch.isfinite(local.flat).all():
            raise TrainerFailed("the workload's parameters after its inner steps are not finite (NaN or inf); "
                                "nothing of this round was shared")

    def publish(self) -> None:
        """Hand the trainer the swarm's parameters (hivemind's) for its next request."""
        self.link.params.tensor.copy_(self.flat.detach())
        self.version += 1


def run(assignment: dict, host: str, workdir: Path, stop: threading.Event, settings: Settings,
        inputs: Inputs = Inputs(), max_seconds: float | None = None, authority: str = "") -> int:
    import torch
    from gpuswarm.dht.hivemind_adapter import (
        averager_compression,
        averager_options,
        chunk_timeout,
        install_robust_reducer,
        optimizer_class,
        throttle_matchmaking,
    )
    from gpuswarm.dht.swarm import SwarmDHT
    from gpuswarm.dht.validators import validators
    from gpuswarm.node.attest import ClaimAttestor, RoundResult
    from gpuswarm.node.evidence import RoundEvidence
    from gpuswarm.node.local_updates import (
        INNER_CHUNK_SECONDS,
        STATE_AVERAGING_EVERY,
        LocalUpdates,
        choose_inner_steps,
        first_round_estimate,
        group_pace,
        group_samples,
        lands_on_inner,
        lone_round_steps,
        next_inner_steps,
        round_steps_cap,
        steps_to_target,
        swarm_samples_after,
    )
    from gpuswarm.node.workloads.saved import flat_optimizer_state, load_checkpoint
    from gpuswarm.proto.models import Assignment
    from gpuswarm.proto.trainer import InnerDone, OptimizerSpec, Position, StepDone

    a = Assignment.model_validate(assignment)
    inflate, lazy = claim_inflation(), lazy_fault()
    spec = a.spec
    link = TrainerLink(workdir, settings)
    dht = optimizer = attestor = None
    finished = False  # the stop rule was met: the run is over
    done = threading.Event()  # ends this run's helper threads
    try:
        # The trainer builds the model and measures its initial metrics before this node joins anyone: a broken
        # workload or a stop rule it cannot meet fails here, in seconds, with the reason. The trainer runs at a
        # lower priority, so a CPU-bound training loop cannot starve this process's all-reduce rounds on a shared
        # CPU (a 2-core host running several nodes would otherwise miss every matchmaking deadline).
        hello = start_trainer(link, spec, inputs)
        check_stop_rule(spec.stop, hello.metrics, hello.train_size)
        shared = SharedParams(link)
        options = spec.training
        if options.mode in ("diloco", "fedavg"):
            # The workload's optimizer steps the trainer's inner copy on every batch; hivemind's steps the swarm's
            # parameters with the outer SGD on the averaged pseudo-gradient once a round. FedAvg is the outer step
            # at rate 1 without momentum: the swarm takes its members' parameters, averaged by samples.
            local = LocalUpdates([shared.flat])
            fedavg = options.mode == "fedavg"
            outer = OptimizerSpec(name="sgd", lr=1.0 if fedavg else options.outer_learning_rate,
                                  momentum=0.0 if fedavg else options.outer_momentum,
                                  nesterov=not fedavg and options.outer_momentum > 0)
        else:
            local, outer = None, hello.optimizer
            shared.bind_grads()
        # What the trainer writes (its state for a checkpoint, the final model) is read back as bytes, never
        # unpickled here, and at most what the sandbox's memory could have held.
        file_limit = settings.limits.memory_bytes or settings.limits.file_bytes
        resumed = load_checkpoint(inputs.checkpoint) if inputs.checkpoint is not None else None
        logger.info("training %s on %s%s, %s, %d torch threads", spec.label, ", ".join(hello.devices),
                    " (bf16 autocast)" if hello.bf16 else "",
                    "sandboxed" if settings.sandboxed else "NOT sandboxed (built-in workload)", given_threads())

        outliers = OutlierLog(workdir / "outliers.jsonl")

        rounds: dict[int, RoundResult] = {}  # the last few rounds this node took part in, by epoch

        def report_round(result: RoundResult) -> None:
            rounds[result.epoch] = result
            for epoch in sorted(rounds)[:-4]:
                del rounds[epoch]
            emit("round", job_id=a.job_id, epoch=result.epoch, solo=result.solo, claims=result.claims,
                 suspects=outliers.new_peers())

        def report_failed_round(epoch: int, error: BaseException) -> None:
            # For the daemon's metrics only: hivemind has already fallen back to this node's local gradients.
            emit("round_failed", job_id=a.job_id, epoch=epoch, error=repr(error)[:200])

        daemon = DaemonSigner()
        # It stores and reads only records chained to the coordinator's key (gpuswarm.dht.validators).
        dht = SwarmDHT(
            initial_peers=a.initial_peers, host_maddrs=[f"/ip4/{host}/tcp/0"], start=True,
            record_validators=validators(authority),
        )
        emit("ready", maddrs=[str(m) for m in dht.get_visible_maddrs()])
        proofs = RecordProofs(dht, daemon, authority, a.node_id)
        proofs.refresh()  # before the first record: without it no peer would accept one
        # Mode "fedavg": a fixed round, `local_epochs` passes over this node's own data (or `inner_steps`).
        fixed_steps = options.inner_steps
        if options.mode == "fedavg" and fixed_steps is None:
            if not hello.train_size:
                raise TrainerFailed('mode "fedavg" counts local_epochs by the workload\'s train_size, which it does '
                                    'not give: set inner_steps')
            fixed_steps = (options.local_epochs or 1) * math.ceil(hello.train_size / hello.batch_size)
        fedavg_share = fixed_steps * hello.batch_size if options.mode == "fedavg" else None
        membership = Membership(dht, a.run_id, a.node_id, proofs, fedavg_share)
        if (arrived := membership.wait_for(spec.min_nodes, stop)) is not None:
            emit("members", count=arrived)
        membership.keep_fresh(done)
        members = membership.place()[1]
        # Mode "diloco": a round is `inner_steps` local steps on every member; until the first rounds are timed,
        # the step time is a guess and the round time an estimate from the model's size (see local_updates).
        step_seconds = 0.0
        round_seconds = first_round_estimate(sum(shared.sizes), hello.matchmaking_time, members)
        inner_steps = choose_inner_steps(1.0, round_seconds, fixed_steps)
        # A round's steps at most; none on node-local data (federated), whose train_size is this node's alone.
        most = None if spec.local_dataset is not None else round_steps_cap(hello.train_size, hello.batch_size,
                                                                            spec.max_nodes)
        if most is not None and fixed_steps is None:
            inner_steps = min(inner_steps, most)
        last_whole: int | None = None  # the count chosen after the last round that held every member
        last_evaluation = None  # (samples, metrics) at this member's last evaluation
        target_near = False  # a lone member's round was cut short by the line to the target (lone_round_steps)

        def round_target(count: int) -> int:
            """hivemind's sample target for a round: every member's share (members' own in mode "fedavg")."""
            if local is None:
                return hello.target_batch_size
            return membership.round_samples(fedavg_share) if fedavg_share else inner_steps * hello.batch_size * count

        target = round_target(members)
        attestor = ClaimAttestor(daemon, a.node_id, a.job_id, str(dht.peer_id), report_round,
                                 inflate=inflate, on_failed=report_failed_round)
        install_robust_reducer(str(workdir / "outliers.jsonl"))  # before hivemind forks its averagers
        throttle_matchmaking()
        if (factor := byzantine_fault()) is not None:
            poison_outgoing_parts(factor)
        # hivemind.Optimizer that matchmakes ahead of a round only when it has peers, and with local updates never
        # for gradients: their members join a round together, after wait_for_round (hivemind_adapter).
        optimizer = optimizer_class()(
            schedule_gradient_rounds=local is None,
            dht=dht, run_id=a.run_id, target_batch_size=target,
            batch_size_per_step=hello.batch_size, params=[shared.flat], optimizer=outer.build,
            matchmaking_time=hello.matchmaking_time, averaging_timeout=hello.averaging_timeout,
            next_chunk_timeout=chunk_timeout(hello.matchmaking_time, hello.averaging_timeout),
            # A newcomer joining a run in progress takes the current weights and optimizer state from a peer.
            load_state_timeout=60.0,
            # A round starts as soon as every member the job can have has joined it (see averager_options).
            averager_opts={**averager_options(group_size=spec.max_nodes), "request_timeout": 1.0},
            # The swarm's progress every second while a member waits for the others' shares (wait_for_round: it
            # starts the round within a second of the last), less often while it computes (membership.REFRESH_*).
            # Sync rounds are a step long: every second throughout.
            tracker_opts={"max_refresh_period": REFRESH_COMPUTING if local is not None else REFRESH_WAITING},
            grad_compression=averager_compression(options.compression), verbose=False,
            # Local updates keep the members' parameters alike by themselves (every whole round applies the same
            # averaged update to the same anchor): hivemind's parameter averaging only mends drift, so it runs
            # every STATE_AVERAGING_EVERY rounds, not after each (sync mode keeps hivemind's every round).
            average_state_every=STATE_AVERAGING_EVERY if local is not None else 1,
            # Every gradient round carries this node's signed claim as gather data (see gpuswarm.node.attest).
            grad_averager_factory=attestor.averager_factory,
        )
        if resumed is not None:
            # Every member of a run that lost all its nodes resumes from the same checkpoint (the trainer loaded
            # its model part); a member that finds peers further on loads their state instead (hivemind does, in
            # its first step).
            optimizer.load_state_dict(flat_optimizer_state(resumed["optimizer"]))
            name = a.checkpoint.name if a.checkpoint is not None else inputs.checkpoint.name
            logger.info("resumed from %s at step %d", name, optimizer.local_epoch)
            emit("resumed", step=optimizer.local_epoch, checkpoint=name)
        attestor.attach(lambda: optimizer.local_epoch)
        checkpoints = Checkpoints(spec.training, workdir / "checkpoints")
        last_epoch = optimizer.local_epoch
        resume_position = resumed and resumed.get("data_position")
        samples_total, round_samples, started = 0, 0, time.time()
        waited = 0.0  # seconds this member has waited for the others' shares of the current round
        # What another node needs to re-compute each round (a referee's audit: gpuswarm.node.evidence).
        evidence = RoundEvidence(workdir / "evidence") if local is not None else None

        def inner_state() -> dict:
            """The trainer's inner optimizer state at the round's start (for the evidence), read as tensors only."""
            link.request("save_inner", "saved", "saving the inner optimizer's state", version=shared.version,
                         name="inner.pt")
            try:
                return torch.load(io.BytesIO(link.take_file("inner.pt", file_limit)), map_location="cpu",
                                  weights_only=True)
            except Exception as e:  # noqa: BLE001 - what the job's code wrote: unreadable fails the job
                raise TrainerFailed(f"the workload's inner optimizer state is unreadable: {e}") from None

        if evidence is not None:
            evidence.begin([shared.flat])
        round_start = True  # the next request to the trainer is the first of a round
        mark = time.monotonic()  # where the time this node's steps took was last counted up to
        swarm_samples = last_epoch * target  # the swarm's samples so far, for the data epochs a stop rule counts
        while not stop.is_set():
            if max_seconds is not None and time.time() - started > max_seconds:
                raise TrainerFailed(f"the job ran past this node's wall-time limit for a job ({max_seconds:.0f}s)")
            index, count = membership.place()
            began = time.monotonic()
            first_step = samples_total == 0
            # Node-local data (federated) is this node's alone: all of it is its shard.
            shard = (0, 1) if spec.local_dataset is not None else (index, count)
            if local is not None:
                # The rest of this member's share of the round (one step first: see wait_for_tracker below), in
                # requests of at most INNER_CHUNK_SECONDS.
                wanted = 1 if first_step else max(1, -(-(inner_steps * hello.batch_size - round_samples)
                                                        // hello.batch_size))
                if lazy:  # claims the steps, computes nothing: its parameters stay where the round started
                    done_step = InnerDone(kind="inner", steps=wanted, samples=wanted * hello.batch_size, seconds=0.0,
                                          loss=0.0, position=Position(index=shard[0], count=shard[1], seed=0,
                                          batches=samples_total // hello.batch_size + wanted))
                else:
                    done_step = link.request("inner", "inner", f"computing the inner steps of round "
                                             f"{optimizer.local_epoch + 1}", extra_time=INNER_CHUNK_SECONDS,
                                             version=shared.version, steps=wanted, seconds=INNER_CHUNK_SECONDS,
                                             index=shard[0], count=shard[1], step=optimizer.local_epoch,
                                             resume=resume_position, round_start=round_start)
                    shared.take_inner(local)
                round_start = False
            elif lazy:
                done_step = StepDone(kind="step", samples=hello.batch_size, seconds=0.0, loss=0.0, position=Position(
                    index=shard[0], count=shard[1], seed=0, batches=samples_total // hello.batch_size + 1))
                shared.grad_flat.zero_()
            else:
                done_step = link.request("step", "step", f"computing step {optimizer.local_epoch + 1}",
                                         version=shared.version, index=shard[0], count=shard[1],
                                         step=optimizer.local_epoch, resume=resume_position)
                shared.take_grads()
            steps_taken = getattr(done_step, "steps", 1)
            resume_position = None
            # Recorded before optimizer.step(): a round scheduled inside that step claims these batches, which
            # hivemind has accumulated by then. The seconds are this process's own clock on its steps since the
            # last count (the previous optimizer step included; rounds and waits not): what the group's pace
            # is read from, never the trainer's figure, which comes from the job's code.
            counted = time.monotonic()
            attestor.meter.record(done_step.samples, counted - mark, steps_taken)
            mark = counted
            if local is not None and not first_step:  # the first request also warmed the trainer up
                step_seconds = ema(step_seconds, (counted - began) / steps_taken)
            if local is not None:
                local.advance(done_step.samples)
                evidence.record(steps_taken, done_step.samples, done_step.position.model_dump())
                if not first_step and 1 < count >= spec.max_nodes \
                        and round_samples + done_step.samples >= inner_steps * hello.batch_size:
                    # This member's share of the round is done: its group assembles while the others finish
                    # theirs, and once it is full the round is due (wait_for_round). Only in a job at its max_nodes:
                    # a group that cannot fill would wait out the whole ROUND_WAIT.
                    optimizer.schedule_round_now(ROUND_WAIT)
            stepping = time.monotonic()
            optimizer.step(batch_size=done_step.samples if local is not None else None)
            stepped = time.monotonic()
            samples_total += done_step.samples
            round_samples += done_step.samples
            attestor.poll()  # reports the round that just finished, or the epoch this node ended alone
            if first_step:
                # The tracker publishes a peer only once it has accumulated samples: one step first, then wait.
                wait_for_tracker(optimizer, spec.min_nodes, stop)
                mark = time.monotonic()
            if optimizer.local_epoch == last_epoch:
                if local is not None:
                    if round_samples >= inner_steps * hello.batch_size:
                        waiting = time.monotonic()
                        wait_for_round(optimizer, stop, lambda: round_target(membership.place()[1]))
                        if membership.place()[1] < spec.max_nodes and optimizer.drop_round_looking():
                            logger.info("a member left during the round: its group is matched afresh")
                        mark = time.monotonic()
                        waited += mark - waiting
                continue
            # An averaged step (or the state loaded from a peer) changed the parameters: the trainer takes them.
            own_target = optimizer.tracker.target_batch_size
            if local is None:
                swarm_samples = swarm_samples_after(swarm_samples, optimizer.local_epoch - last_epoch, own_target)
            else:
                group = rounds.get(last_epoch)
                # A round this node took alone is never audited (no peer attested it): no evidence to keep.
                if group is None or not group.solo:
                    evidence.end(last_epoch, local.params, inner_state)
                elif count == 1 and lands_on_inner(outer):
                    # The run's only member, whose outer step is anchor − 1·(anchor − inner): the anchor is the inner
                    # parameters, and it trains exactly as one process does (not a float rounding away each round).
                    # With others in the run, the state may have been averaged with them in this step, or is loaded
                    # from a peer below: hivemind's result stays.
                    local.land_on_inner()
                if (group is None or group.solo) and count > 1:
                    # Alone while others train (it started late, or its round failed: none is reported yet when
                    # hivemind gave up waiting on it): the outer step made this node's own inner parameters its
                    # anchor, which no later round would bring back to the swarm's (their pseudo-gradients would
                    # differ, and be clipped as an outlier's). It takes the swarm's state from a peer that has
                    # reached its epoch. While none has, hivemind would refuse the download as behind (seen in the
                    # lab: 7 s spent for nothing, on the member whose all-reduce failed first); the others, whose
                    # round failed with it, load this node's state when they get here.
                    if membership.level_with(optimizer.local_epoch):
                        logger.info("round of epoch %d was not averaged with the %d members: loading the swarm's "
                                    "state from a peer", last_epoch, count)
                        optimizer.load_state_from_peers()
                    else:
                        logger.info("round of epoch %d was not averaged with the %d members, and none has reached "
                                    "epoch %d: keeping this node's state", last_epoch, count, optimizer.local_epoch)
                local.restart()
                round_start = True
                # An averaged round: its group's claims, never more than the round's target (a groupmate's claim
                # is its own word). Otherwise what the others counted at this epoch, when any got there.
                alone = group is None or group.solo
                averaged = None if alone else min(own_target, group_samples(c["payload"] for c in group.claims))
                swarm_samples = swarm_samples_after(
                    swarm_samples, optimizer.local_epoch - last_epoch, own_target, averaged,
                    published=membership.published_samples(optimizer.local_epoch) if alone and count > 1 else None)
                # The pace of the group whose round just ended (its claims are for the epoch it ended), alike on
                # every member, so that all take the same inner steps; this node's own timing when it was alone.
                pace = group_pace(c["payload"] for c in group.claims) if group and group.group_size > 1 else None
                # Every member takes the same count (next_inner_steps): one that took fewer steps would send a
                # shorter pseudo-gradient, which the others' robust reducers clip and name as an outlier, and groups
                # that took different counts would never meet again.
                whole = (group.group_size if group else 1) >= count
                inner_steps = next_inner_steps(fixed_steps, pace, (step_seconds, round_seconds), whole, last_whole,
                                               lambda: membership.agreed_steps(optimizer.local_epoch), most)
                if whole:
                    last_whole = inner_steps
                membership.publish_pace(optimizer.local_epoch, inner_steps, swarm_samples)
                logger.info("round of epoch %d (%d of %d members, group's pace %s; %.1f s waiting for the others, "
                            "%.1f s averaging): %d inner steps next", last_epoch, group.group_size if group else 1,
                            count, pace, waited, stepped - stepping, inner_steps)
                optimizer.tracker.target_batch_size = round_target(count)
            shared.publish()
            if evidence is not None:
                evidence.begin([shared.flat])
            last_epoch = step = optimizer.local_epoch
            round_samples, waited = 0, 0.0
            metrics = link.request("evaluate", "metrics", f"evaluating step {step}", version=shared.version).metrics
            # Passes over the swarm's data; node-local data (federated) are this node's part of it, one of `count`.
            data_size = (hello.train_size or 0) * (count if spec.local_dataset is not None else 1)
            epochs = swarm_samples / data_size if data_size else None
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
                link.request("save_model", "saved", "saving the final model", version=shared.version,
                             name="model.pt", metrics=metrics,
                             metadata={"job_id": a.job_id, "global_step": step, "epoch": epochs,
                                       "accuracy": accuracy, "stopped": reason})
                path = workdir / "model.pt"
                link.take_file("model.pt", file_limit, dest=path)
                if not zipfile.is_zipfile(path):
                    raise TrainerFailed("the final model file the workload wrote is not a torch.save file")
                logger.info("stop rule met: %s", reason)
                emit("finished", path=str(path), accuracy=accuracy if accuracy is not None and 0 <= accuracy <= 1
                     else None, epoch=round(epochs or 0.0, 3), global_step=step, metrics=metrics, reason=reason)
                finished = True
                return 0
            if local is not None and fixed_steps is None and count == 1:
                # A lone member's next round ends no later than the line through its last two evaluations
                # reaches the stop rule's target, and stays short once the target is that near (lone_round_steps).
                evaluation = (samples_total, metrics)
                estimate = steps_to_target(spec.stop.metric_targets(), last_evaluation, evaluation, hello.batch_size)
                last_evaluation = evaluation
                full, inner_steps = inner_steps, lone_round_steps(inner_steps, estimate, target_near, step_seconds)
                cut = estimate is not None and estimate < full  # the line reaches the target within the round
                target_near = target_near or cut
                if inner_steps < full:
                    optimizer.tracker.target_batch_size = round_target(count)
                    logger.info("the stop rule's target is %s: the next round takes %d inner steps",
                                f"about {estimate} inner steps away" if cut
                                else "near and no line reaches it within a round", inner_steps)
            if index == 0 and checkpoints.due(step):
                link.request("save_state", "saved", f"saving the state of step {step}", version=shared.version,
                             name="state.pt")
                state = link.take_file("state.pt", file_limit)
                path = checkpoints.write(state, optimizer, step, samples_total, done_step.position.model_dump())
                emit("checkpoint", path=str(path), step=step)
            mark = time.monotonic()  # the round, the evaluation and the checkpoint were no step's time
            if local is not None:  # what this node's rounds cost outside their inner steps (next_inner_steps' `own`)
                round_seconds = ema(round_seconds, mark - stepping)
        return 0
    finally:
        done.set()
        link.close(timeout=5.0)
        if optimizer is not None:
            optimizer.shutdown()
            if finished:
                leave_last_record(optimizer.tracker)
        if attestor is not None and optimizer is not None:
            # Rounds that finished while the optimizer shut down (it tags along with a running round) still count.
            # Work since the last round was never averaged into the model, so it is not claimed.
            attestor.finish()
        if dht is not None:
            dht.shutdown()


def given_threads() -> int:
    """The torch threads the runner gave this job (GPUSWARM_TORCH_THREADS; see `runner.torch_threads`)."""
    return int(os.environ.get(THREADS_ENV) or 1)


def start_trainer(link: TrainerLink, spec, inputs: Inputs):
    """Start the job's trainer on this process's GPUs (CUDA_VISIBLE_DEVICES) and threads (GPUSWARM_TORCH_THREADS),
    both set by the runner, at the nice level the daemon asks for; its Hello."""
    from gpuswarm.node.trainer import configure_torch

    threads = given_threads()
    configure_torch(threads)  # this process steps the outer optimizer and reduces the peers' parts on the CPU
    gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return link.start(spec.model_dump(mode="json"), inputs, gpus, threads,
                      int(os.environ.get("GPUSWARM_TRAIN_NICE", "10")))


def referee(spec: dict, workdir: Path, settings: Settings, inputs: Inputs, path: Path) -> int:
    """Re-compute another node's round from its evidence file `path` with the job's workload (`spec`, sandboxed
    as its training is) and emit the verdict (gpuswarm.node.evidence)."""
    from gpuswarm.node import evidence
    from gpuswarm.node.local_updates import LocalUpdates
    from gpuswarm.proto.models import JobSpec

    link = TrainerLink(workdir, settings)
    try:
        hello = start_trainer(link, JobSpec.model_validate(spec), inputs)
        shared = SharedParams(link)
        try:
            kept = evidence.load(path, sum(shared.sizes))
        except evidence.EvidenceError as e:
            emit("verdict", epoch=None, steps=0, samples=0, distance=None, passed=False, reason=str(e))
            return 0
        result = evidence.replay(kept, link, shared, LocalUpdates([shared.flat]), hello.optimizer)
        logger.info("replayed round %s: %s", result["epoch"], "passed" if result["passed"] else result["reason"])
        emit("verdict", **result)
        return 0
    finally:
        link.close(timeout=5.0)


def ema(previous: float, value: float, weight: float = 0.5) -> float:
    """An exponential moving average; the first value (previous 0) is taken as it is."""
    return value if previous <= 0 else weight * value + (1 - weight) * previous


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


def wait_as_spare(fd: int = 0) -> list[str] | None:
    """A spare worker (`worker --spare`, started by the runner while the node is idle). Before there is a job it
    loads what every job's worker needs: torch, hivemind, torch._dynamo (which a torch optimizer imports on first
    use) and the rest of what `run` imports, about 6 CPU-seconds (15 s under a 0.4 CPU quota). Then it waits for one
    JSON line on `fd`, {"argv": [...], "env": {...}, "log": path}, sets the job's environment, sends its stderr to
    the job's log and returns the job's arguments; None when `fd` closed first (the runner dropped the spare)."""
    import importlib

    import torch
    from gpuswarm.dht.hivemind_adapter import optimizer_class

    optimizer_class()  # hivemind
    for module in SPARE_IMPORTS:
        importlib.import_module(module)
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    torch.optim.SGD([param], lr=0.1).step()
    line = bytearray()
    while not line.endswith(b"\n"):  # a byte at a time: what follows the line is the DaemonSigner's
        byte = os.read(fd, 1)
        if not byte:
            return None
        line += byte
    job = json.loads(line)
    os.environ.update(job["env"])
    log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 2)
    os.close(log)
    return [str(a) for a in job["argv"]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == [SPARE_FLAG]:
        die_with_parent()
        if (argv := wait_as_spare()) is None:
            return 0
    parser = argparse.ArgumentParser(prog="gpuswarm-worker")
    parser.add_argument("assignment", type=Path, help="the assignment's JSON (with --replay: {\"spec\": the job's})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--code", type=Path, help="the job's code: an unpacked directory or a wheel")
    parser.add_argument("--dataset", type=Path, help="the job's dataset: a file or an unpacked directory")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint to resume from when no peer has the state")
    parser.add_argument("--sandbox", action=argparse.BooleanOptionalAction, default=True,
                        help="run the workload in a bubblewrap sandbox (--no-sandbox: built-in workloads only)")
    parser.add_argument("--limits", help="the sandbox's limits, JSON of gpuswarm.node.sandbox.Limits")
    parser.add_argument("--answer-timeout", type=float, default=600.0,
                        help="seconds the workload may take for one step, evaluation or save")
    parser.add_argument("--max-hours", type=float, help="wall-time limit of the job on this node")
    parser.add_argument("--authority", default="", help="the coordinator's key the run's DHT records chain to")
    parser.add_argument("--hide", type=Path, action="append", default=[],
                        help="a path of the node's state the workload must never see (repeatable)")
    parser.add_argument("--replay", type=Path, metavar="EVIDENCE",
                        help="do not train: re-compute the round in this evidence file and emit a verdict")
    args = parser.parse_args(argv)
    die_with_parent()
    logs.configure("info", os.environ.get(logs.FORMAT_ENV, "text"), "worker")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    assignment = json.loads(args.assignment.read_text())
    from gpuswarm.node import sandbox
    from gpuswarm.sdk.loader import WorkloadError

    limits = sandbox.Limits(**json.loads(args.limits)) if args.limits else sandbox.Limits()
    settings = Settings(sandboxed=args.sandbox, limits=limits, answer_timeout=args.answer_timeout,
                        hide=tuple(args.hide))
    if args.sandbox and (why := sandbox.unavailable_reason()) is not None:
        emit("error", reason=f"this node cannot sandbox the job's code: {why}")
        return WORKLOAD_FAILED
    try:
        if args.replay is not None:
            return referee(assignment["spec"], args.workdir, settings, Inputs(args.code, args.dataset), args.replay)
        return run(assignment, args.host, args.workdir, stop, settings,
                   Inputs(args.code, args.dataset, args.checkpoint),
                   args.max_hours * 3600 if args.max_hours else None, args.authority)
    except (TrainerFailed, WorkloadError) as e:
        logger.error("training failed: %s", e)
        emit("error", reason=str(e))
        return WORKLOAD_FAILED


if __name__ == "__main__":
    sys.exit(main())
