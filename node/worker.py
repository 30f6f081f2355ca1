"""The training process: one per job on a node, started and supervised by `gpuswarm.node.runner`.

Owns the hivemind DHT peer and `hivemind.Optimizer` of one job run, the training loop, evaluation against the
stop rule, and saving the final model. It talks to its parent only through JSON lines on stdout (prefixed with
`EVENT_PREFIX`, so stray prints cannot be mistaken for events) and its exit code; it never talks to the
coordinator, so training goes on while the coordinator is down. Crashes here cannot take the daemon down.

Contribution accounting is peer-attested (`gpuswarm.node.attest`): in every gradient all-reduce round the node
shares a claim signed with the daemon's key (`--key`, the daemon's identity file) through the averager's gather
data, and emits one "round" event per round with the signed claims of its whole group, its own first. The daemon
turns that into a RoundReport. A round that failed gives a "round_failed" event, which only the daemon's metrics
count.

Test-only fault injection: GPUSWARM_FAULT_INFLATE_CLAIMS=<factor> multiplies the samples and compute seconds in this
node's OWN claims (those it shares and those it reports), to play a lying node in end-to-end tests of the ledger.
Never set it in production; the worker logs a warning when it is set.

Run as: python -m gpuswarm.node.worker ASSIGNMENT_JSON --host ADDRESS --workdir DIR --key IDENTITY_KEY
"""

from __future__ import annotations

import argparse
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
MEMBER_RECORD_TTL = 24 * 3600.0
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


def wait_for_members(dht, run_id: str, node_id: str, min_nodes: int, stop: threading.Event) -> None:
    """Hold training until `min_nodes` members of the run have checked in, so a fast first node does not finish the
    job alone before its peers arrive. A node joining a run in progress finds the earlier members' records and goes
    straight on (and then loads the current state from a peer)."""
    from hivemind.utils import get_dht_time

    key = f"{run_id}.members"
    dht.store(key, subkey=node_id, value=time.time(), expiration_time=get_dht_time() + MEMBER_RECORD_TTL)
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT
    count = 0
    while not stop.is_set() and time.monotonic() < deadline:
        found = dht.get(key, latest=True)
        count = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if count >= min_nodes:
            emit("members", count=count)
            return
        time.sleep(0.5)
    logger.warning("only %d of %d members arrived within %.0fs; training anyway", count, min_nodes, RENDEZVOUS_TIMEOUT)


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


def run(assignment: dict, host: str, workdir: Path, stop: threading.Event, key_path: Path) -> int:
    import hivemind
    import torch
    from gpuswarm.dht.swarm import SwarmDHT
    from gpuswarm.dht.validators import NodeAdvertValidator
    from gpuswarm.node.attest import ClaimAttestor, RoundResult
    from gpuswarm.node.workloads import build_workload
    from gpuswarm.proto.models import Assignment

    torch.set_num_threads(int(os.environ.get("GPUSWARM_TORCH_THREADS", "1")))
    a = Assignment.model_validate(assignment)
    identity = load_identity(key_path)
    if identity.node_id != a.node_id:
        raise SystemExit(f"the assignment is for node {a.node_id}, but {key_path} is node {identity.node_id}'s key")
    inflate = claim_inflation()
    spec = a.spec
    workload = build_workload(spec.workload, spec.hyperparameters, a.shard_index, a.num_shards)
    hp = spec.hyperparameters

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
    try:
        emit("ready", maddrs=[str(m) for m in dht.get_visible_maddrs()])
        wait_for_members(dht, a.run_id, a.node_id, spec.min_nodes, stop)
        attestor = ClaimAttestor(identity.private_key, a.job_id, str(dht.peer_id), report_round, inflate=inflate,
                                 on_failed=report_failed_round)
        optimizer = hivemind.Optimizer(
            dht=dht, run_id=a.run_id, target_batch_size=workload.target_batch_size,
            batch_size_per_step=workload.batch_size, params=workload.model.parameters(),
            optimizer=lambda params: torch.optim.Adam(params, lr=workload.learning_rate),
            matchmaking_time=hp["matchmaking_time"], averaging_timeout=hp["averaging_timeout"],
            # A newcomer joining a run in progress takes the current weights and optimizer state from a peer.
            load_state_timeout=60.0, averager_opts={"request_timeout": 1.0}, verbose=False,
            # Every gradient round carries this node's signed claim as gather data (see gpuswarm.node.attest).
            grad_averager_factory=attestor.averager_factory,
        )
        attestor.attach(lambda: optimizer.local_epoch)
        # The averager and DHT run in their own processes, already started. Lowering only this process's priority
        # keeps a CPU-bound training loop from starving the all-reduce rounds on a shared CPU (a 2-core host
        # running several nodes would otherwise miss every matchmaking deadline).
        os.nice(int(os.environ.get("GPUSWARM_TRAIN_NICE", "10")))
        last_epoch = optimizer.local_epoch
        samples_total, started = 0, time.time()
        for batch in workload.batches():
            if stop.is_set():
                break
            t0 = time.perf_counter()
            loss = workload.loss(batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"training loss is {loss.item()}; refusing to share non-finite gradients")
            loss.backward()
            n = len(batch[1])
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

            if optimizer.local_epoch != last_epoch:
                last_epoch = optimizer.local_epoch
                test_loss, accuracy = workload.evaluate()
                epochs = last_epoch * workload.target_batch_size / workload.train_size
                elapsed = max(time.time() - started, 1e-6)
                emit("progress", job_id=a.job_id, epoch=round(epochs, 3), global_step=last_epoch,
                     samples=samples_total, loss=round(test_loss, 5), accuracy=round(accuracy, 5),
                     samples_per_second=round(samples_total / elapsed, 2),
                     peers=optimizer.tracker.global_progress.num_peers)
                rule = spec.stop
                if (rule.target_accuracy is not None and accuracy >= rule.target_accuracy) or (
                    rule.max_epochs is not None and epochs >= rule.max_epochs
                ):
                    path = workdir / "model.pt"
                    metadata = {"job_id": a.job_id, "accuracy": accuracy, "epoch": epochs, "global_step": last_epoch}
                    workload.save(str(path), metadata)
                    emit("finished", path=str(path), accuracy=accuracy, epoch=round(epochs, 3))
                    return 0
        return 0
    finally:
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
    args = parser.parse_args(argv)
    die_with_parent()
    logs.configure("info", os.environ.get(logs.FORMAT_ENV, "text"), "worker")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    assignment = json.loads(args.assignment.read_text())
    return run(assignment, args.host, args.workdir, stop, args.key)


if __name__ == "__main__":
    sys.exit(main())
