"""The GPU challenge's solver process (`python -m gpuswarm.node.challenge`): it computes exactly what the in-process
solver computes, it is another process, warmed up before the coordinator's clock starts and gone after the
challenge, the daemon never imports torch for it, and cancelling, the give-up deadline, a crash or the daemon's
death all end it within a bounded time. Everything runs on this machine's CPU with small n; the CUDA path needs a
GPU and is not run here."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from gpuswarm.node.challenge import (
    DEADLINE_MARGIN,
    GIVE_UP_GRACE,
    Challenger,
    SolverFailed,
    answer,
    solve,
    start_solver,
)
from gpuswarm.proto import challenge as ch
from gpuswarm.proto.challenge import ChallengeIssue, ChallengeResult, ChallengeReveal, CommitAnswer
from gpuswarm.proto.models import Resources

N = 512
SLOW_N = 8192  # about 1.1 TFLOP: tens of seconds on this CPU, so the solver is surely busy when the test acts
CPU = Resources(cpu_cores=2, ram_gb=4)
NODE_ID = "0123456789abcdef"
SEED = "5e" * 16
START_TIMEOUT = 60.0  # a loaded 2-core CI machine can take seconds to import torch in the solver process
HERE = Path(__file__).resolve().parent


def issue(n: int = N, time_limit: float = 60.0) -> ChallengeIssue:
    return ChallengeIssue(challenge_id="c-0123456789abcdef", node_id=NODE_ID, seed=SEED, n=n,
                          device_class="CPU (2 cores)", time_limit=time_limit, issued_at=0.0, deadline=time_limit)


def reveal(rows: list[int] = [0, 5, 511]) -> ChallengeReveal:  # noqa: B006 - never mutated
    return ChallengeReveal(challenge_id=issue().challenge_id, r_seed="77" * 16, rows=rows, proof_deadline=0.0)


def gone(pid: int) -> bool:
    """The process has ended (a zombie has ended too: only its exit status is left for its parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


class CheckingCoordinator:
    """The coordinator's side in memory: issues one challenge, reveals, and checks the proof with the real checks.
    At the start it records the solver process the challenger had ready (the clock must not count its start-up)."""

    def __init__(self, n: int = N, time_limit: float = 60.0):
        self.n, self.time_limit = n, time_limit
        self.challenger: Challenger | None = None
        self.issued: ChallengeIssue | None = None
        self.solver_pid: int | None = None
        self.solver_device: str | None = None
        self.root: str | None = None
        self.commits = 0

    async def challenge_start(self) -> ChallengeIssue:
        solver = self.challenger.solver if self.challenger is not None else None
        if solver is not None:
            self.solver_pid, self.solver_device = solver.pid, solver.device
        self.issued = issue(self.n, self.time_limit)
        return self.issued

    async def challenge_commit(self, commit) -> CommitAnswer:
        self.commits += 1
        self.root = commit.root
        return CommitAnswer(challenge_id=commit.challenge_id, reveal=reveal())

    async def challenge_proof(self, proof) -> ChallengeResult:
        product, opened = ch.decode_proof(proof, self.n, reveal().rows)
        verdict = ch.check_proof(SEED, self.n, self.root, reveal().r_seed, product, opened)
        return ChallengeResult(challenge_id=proof.challenge_id, node_id=proof.node_id, passed=verdict.passed,
                               reason=verdict.reason, device_class="CPU (2 cores)", n=self.n, seconds=0.1,
                               time_limit=self.time_limit, verified=verdict.passed)


def challenger_for(coordinator: CheckingCoordinator, **kwargs) -> Challenger:
    challenger = Challenger(coordinator, CPU, NODE_ID, **kwargs)
    coordinator.challenger = challenger
    return challenger


def fake_solver(then: str) -> list[str]:
    """A stand-in solver process that gets ready at once and, asked to solve, does `then` (Python)."""
    script = ("import json, sys\n"
              "sys.stdin.readline()\n"
              "print(json.dumps({'event': 'ready', 'device': 'cpu'}), flush=True)\n"
              "sys.stdin.readline()\n" + then + "\n")
    return [sys.executable, "-c", script]


# ---------------------------------------------------------------------------------------------------- the solution


async def test_the_solver_process_computes_exactly_the_in_process_solution():
    reference = solve(issue())
    async with start_solver(CPU) as solver:
        pid = solver.pid
        assert solver.device == "cpu"
        assert pid != os.getpid() and psutil.Process(pid).ppid() == os.getpid()
        root, seconds = await solver.solve(issue(), give_up_at=None)
        assert root == reference.root and seconds > 0
        proof = await solver.answer(reveal(), NODE_ID)
    assert proof == answer(reference, reveal(), NODE_ID)
    assert solver.process.returncode == 0 and gone(pid)  # it exited by itself after the proof


async def test_a_challenge_runs_in_a_solver_process_warmed_up_before_the_clock_and_gone_after_it():
    coordinator = CheckingCoordinator()
    challenger = challenger_for(coordinator)
    result = await challenger.run_once()
    assert result is not None and result.passed, result
    assert coordinator.solver_device == "cpu"  # ready (torch imported, warmed up) when the challenge was asked for
    assert coordinator.solver_pid not in (None, os.getpid())
    assert gone(coordinator.solver_pid) and challenger.solver is None


def test_the_daemon_process_never_imports_torch_for_a_challenge():
    script = ("import asyncio, json, sys\n"
              f"sys.path.insert(0, {str(HERE)!r})\n"
              "from test_challenge_child import CheckingCoordinator, challenger_for\n"
              "assert 'torch' not in sys.modules\n"
              "result = asyncio.run(challenger_for(CheckingCoordinator()).run_once())\n"
              "print(json.dumps({'passed': result.passed, 'torch': 'torch' in sys.modules}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"passed": True, "torch": False}


# ---------------------------------------------------------------------------------------------------- ending it


async def test_cancelling_a_challenge_kills_its_solver_process_promptly():
    coordinator = CheckingCoordinator(n=SLOW_N, time_limit=600.0)
    challenger = challenger_for(coordinator)
    challenger.on_heartbeat({"ok": True, "challenge": True})
    await wait_until(lambda: coordinator.issued is not None, START_TIMEOUT, "the challenge was issued")
    pid = coordinator.solver_pid
    await asyncio.sleep(0.5)  # it is multiplying now
    assert not gone(pid)
    started = time.monotonic()
    await challenger.stop()
    assert time.monotonic() - started < 3.0
    assert gone(pid) and not challenger.running and coordinator.commits == 0


async def test_the_solver_process_gives_up_at_the_deadline():
    coordinator = CheckingCoordinator(n=SLOW_N, time_limit=0.3)
    challenger = challenger_for(coordinator)
    task = asyncio.create_task(challenger.run_once())
    await wait_until(lambda: coordinator.issued is not None, START_TIMEOUT, "the challenge was issued")
    started = time.monotonic()
    assert await task is None
    assert time.monotonic() - started < coordinator.time_limit + GIVE_UP_GRACE + DEADLINE_MARGIN + 2.0
    assert gone(coordinator.solver_pid) and coordinator.commits == 0


async def test_a_solver_that_does_not_give_up_by_itself_is_killed_at_the_deadline(caplog):
    """The CUDA path is one matmul with no point to stop at: the daemon kills it DEADLINE_MARGIN past the
    deadline. A stand-in solver that never answers plays that part."""
    coordinator = CheckingCoordinator(time_limit=0.2)
    challenger = challenger_for(coordinator, solver_command=fake_solver("import time; time.sleep(600)"))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gpuswarm.node.challenge"):
        assert await challenger.run_once() is None
    elapsed = time.monotonic() - started
    assert coordinator.time_limit + GIVE_UP_GRACE < elapsed < coordinator.time_limit + GIVE_UP_GRACE + 5.0
    assert gone(coordinator.solver_pid) and coordinator.commits == 0
    assert "abandoned: gave up after" in caplog.text


async def test_a_solver_that_dies_before_it_is_ready_fails_before_the_clock_starts(caplog):
    coordinator = CheckingCoordinator()
    challenger = challenger_for(coordinator, solver_command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    with caplog.at_level(logging.ERROR, logger="gpuswarm.node.challenge"):
        assert await challenger.run_once() is None
    assert "exited with code 3" in caplog.text and coordinator.issued is None


async def test_a_solver_that_crashes_mid_challenge_fails_cleanly_in_the_background(caplog):
    coordinator = CheckingCoordinator()
    crash = fake_solver("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    challenger = challenger_for(coordinator, solver_command=crash)
    with caplog.at_level(logging.ERROR, logger="gpuswarm.node.challenge"):
        challenger.on_heartbeat({"ok": True, "challenge": True})
        await wait_until(lambda: not challenger.running, START_TIMEOUT, "the challenge ended")
    assert "was killed by SIGSEGV" in caplog.text and "Traceback" not in caplog.text
    assert coordinator.issued is not None and coordinator.commits == 0 and gone(coordinator.solver_pid)
    await challenger.stop()


async def test_an_exception_in_the_solver_process_is_a_solver_failure():
    async with start_solver(CPU) as solver:
        with pytest.raises(SolverFailed, match="asked for an answer before solving"):
            await solver.answer(reveal(), NODE_ID)
    assert solver.process.returncode == 1 and gone(solver.pid)


def test_the_solver_process_dies_with_the_daemon():
    """PR_SET_PDEATHSIG: a daemon killed with SIGKILL (no cleanup at all) leaves no solver behind."""
    script = ("import asyncio\n"
              "from gpuswarm.node.challenge import start_solver\n"
              "from gpuswarm.proto.models import Resources\n"
              "async def main():\n"
              "    async with start_solver(Resources(cpu_cores=2, ram_gb=4)) as solver:\n"
              "        print(solver.pid, flush=True)\n"
              "        await asyncio.sleep(600)\n"
              "asyncio.run(main())\n")
    daemon = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(daemon.stdout.readline())
        assert not gone(pid)
        daemon.kill()
        daemon.wait(10)
        deadline = time.monotonic() + 10
        while not gone(pid):
            assert time.monotonic() < deadline, "the solver process outlived the daemon"
            time.sleep(0.05)
    finally:
        daemon.kill()
        daemon.wait(10)
