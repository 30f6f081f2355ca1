"""The node's side of the GPU challenge: the solver (torch), its child process, and the task that takes a challenge
when asked.

Owns computing C = A @ B for a `proto.challenge.ChallengeIssue` on the device the node claims (CUDA when it
claims a GPU and torch sees one, else the CPU), committing to C's rows, and answering the reveal. The coordinator
asks through the heartbeat answer (`"challenge": true`); `Challenger.on_heartbeat` then runs one challenge in the
background, and a failed challenge is logged, never raised into the supervisor loop.

Everything that touches torch runs in a child process, one per challenge (`python -m gpuswarm.node.challenge`,
`SolverProcess`): choosing the device, the warm-up, generation, the product, its copy to the host, the Merkle tree
and the answer to the reveal. The daemon never imports torch for the challenge, so it holds no CUDA context and no
cached device memory afterwards; the child exits when the challenge ends, and its GPU memory goes with it. C never
leaves the child: it is only needed there, to answer the reveal. Why, and how the timed window stays the same:
docs/decisions/0014-gpu-challenge-in-a-child-process.md.

The CUDA path has not been run on a GPU in this project's CI (no GPU there); the CPU path is what the tests run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import numpy as np
from gpuswarm.client.api import CoordinatorUnavailable, Rejected
from gpuswarm.node.worker import PARENT_PID_ENV, die_with_parent
from gpuswarm.proto import challenge as proto
from gpuswarm.proto import logs
from gpuswarm.proto.api import HeartbeatAnswer
from gpuswarm.proto.challenge import (
    MAX_PROOF_BYTES,
    ChallengeCommit,
    ChallengeIssue,
    ChallengeProof,
    ChallengeResult,
    ChallengeReveal,
    OpenedRow,
)
from gpuswarm.proto.models import Resources

logger = logging.getLogger("gpuswarm.node.challenge")  # by name: in the solver process, __name__ is "__main__"
CPU_ROW_BLOCK = 64  # rows of C per CPU matmul (divides GEN_BLOCK): between them the solver checks its deadline
GIVE_UP_GRACE = 2.0  # seconds past the time limit (own clock) after which an unfinished product is abandoned
STOP_TIMEOUT = 5.0
SOLVER_MODULE = "gpuswarm.node.challenge"  # run with -m: the solver process
READY_TIMEOUT = 300.0  # seconds for the solver process to import torch and warm up (a cold CUDA start is slow)
DEADLINE_MARGIN = 1.0  # seconds past give_up_at before the daemon kills a solver that has not given up by itself
EXIT_TIMEOUT = 2.0  # seconds an idle solver gets to exit after its stdin closes, and a terminated one to die
REPLY_LIMIT = 4 * MAX_PROOF_BYTES  # bytes in one reply line: a proof is at most MAX_PROOF_BYTES of JSON


class ChallengeAbandoned(RuntimeError):
    """The solver stopped before finishing: past its deadline, or the daemon is shutting down."""


@dataclass
class Solution:
    issue: ChallengeIssue
    product: np.ndarray  # C as int16, on the host
    levels: list[list[bytes]]  # the Merkle tree over C's rows
    seconds: float  # the node's own clock, generation to root

    @property
    def root(self) -> str:
        return self.levels[-1][0].hex()


def choose_device(resources: Resources) -> str:
    """CUDA when the node claims a GPU and torch can use one; the CPU otherwise (also for a node that claims a GPU
    it does not have: it then computes honestly on the CPU and fails the time bound, as it should)."""
    if not resources.gpus:
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    logger.warning("this node claims %d GPU(s) but torch sees none: the challenge runs on the CPU and will "
                   "most likely miss the time bound", resources.gpu_count)
    return "cpu"


def warm_up(device: str) -> None:
    """Import torch and, on CUDA, create the context and cuBLAS handle before the clock starts: both take seconds
    the first time and have nothing to do with the device's speed."""
    import torch

    x = torch.ones((64, 64), device=device)
    (x @ x).sum().item()
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _load(issue: ChallengeIssue, which: int, device: str):
    """Matrix `which` as float32 on `device`: raw bytes from the host, mapped to {-1, 0, 1} on the device (the same
    arithmetic as `proto.challenge.entries`)."""
    import torch

    n = issue.n
    raw = np.empty((n, n), dtype=np.uint8)
    for b in range(n // proto.GEN_BLOCK):
        raw[b * proto.GEN_BLOCK:(b + 1) * proto.GEN_BLOCK] = proto.raw_block(issue.seed, which, b, n)
    on_device = torch.from_numpy(raw).to(device)
    return (on_device % 3).to(torch.float32).sub_(1)  # in place: one float32 copy at the peak, not two


def solve(issue: ChallengeIssue, device: str = "cpu", *, give_up_at: float | None = None,
          cancel: threading.Event | None = None) -> Solution:
    """C = A @ B on `device` and the Merkle tree of its rows. float32 is exact here (see proto.challenge). On the
    CPU the product goes in row blocks, and the solver gives up between blocks once `give_up_at` (time.monotonic)
    has passed or `cancel` is set: a late commitment fails anyway, so there is no point in finishing."""
    import torch

    started = time.monotonic()
    n = issue.n

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise ChallengeAbandoned("cancelled")
        if give_up_at is not None and time.monotonic() > give_up_at:
            raise ChallengeAbandoned(f"gave up after {time.monotonic() - started:.1f}s: the time limit was "
                                     f"{issue.time_limit:.1f}s")

    if device.startswith("cuda"):
        a, b = _load(issue, proto.MATRIX_A, device), _load(issue, proto.MATRIX_B, device)
        c = a @ b
        torch.cuda.synchronize()  # the product is done before anything is timed or copied
        del a, b
        product = c.to(torch.int16).cpu().numpy()  # one copy to the host, 2 bytes per entry
        del c
    else:
        logger.debug("challenge %s: generating B", issue.challenge_id)
        b = _load(issue, proto.MATRIX_B, "cpu")
        product = np.empty((n, n), dtype=np.int16)
        for first in range(0, n, proto.GEN_BLOCK):
            rows = torch.from_numpy(proto.matrix_rows(issue.seed, proto.MATRIX_A, n, first, first + proto.GEN_BLOCK))
            rows = rows.to(torch.float32)
            for start in range(0, proto.GEN_BLOCK, CPU_ROW_BLOCK):
                check()
                logger.debug("challenge %s: rows %d.. at %.1fs", issue.challenge_id, first + start,
                             time.monotonic() - started)
                block = rows[start:start + CPU_ROW_BLOCK] @ b
                product[first + start:first + start + CPU_ROW_BLOCK] = block.to(torch.int16).numpy()
        del b
    check()
    levels = proto.merkle_levels([proto.leaf_hash(row) for row in product])
    return Solution(issue, product, levels, time.monotonic() - started)


def answer(solution: Solution, reveal: ChallengeReveal, node_id: str) -> ChallengeProof:
    """C·r and the revealed rows with their Merkle paths."""
    n = solution.issue.n
    r = proto.reveal_vector(reveal.r_seed, n)
    rows = [OpenedRow(index=i, values=proto.encode_ints(solution.product[i], proto.ROW_DTYPE),
                      path=[h.hex() for h in proto.merkle_path(solution.levels, i)]) for i in reveal.rows]
    return ChallengeProof(challenge_id=solution.issue.challenge_id, node_id=node_id,
                          product=proto.encode_ints(proto.times_vector(solution.product, r), proto.VECTOR_DTYPE),
                          rows=rows)


@dataclass(frozen=True)
class Rehearsal:
    """A challenge of this node's class, issued, solved and checked here: what the coordinator would conclude."""

    issue: ChallengeIssue
    seconds: float  # solving: generate, multiply, hash
    check_seconds: float  # the coordinator's side: decoding and checking the proof
    proof_ok: bool
    reason: str

    @property
    def passed(self) -> bool:
        return self.proof_ok and self.seconds <= self.issue.time_limit

    @property
    def gflops(self) -> float:
        return proto.measured_gflops(self.issue.n, self.seconds)


def rehearse(resources: Resources, device: str) -> Rehearsal:
    """Issue a challenge for `resources`' class as the coordinator would, solve it on `device` to the end (no give
    up: the time is what matters), answer a random reveal and check the proof."""
    import secrets

    klass, n = proto.device_class(resources), proto.challenge_size(resources)
    limit = proto.time_limit(klass, n)
    issue = ChallengeIssue(challenge_id=f"c-{secrets.token_hex(8)}", node_id="0" * 16, seed=secrets.token_hex(16),
                           n=n, device_class=klass.name, time_limit=limit, issued_at=0.0, deadline=limit)
    warm_up(device)
    solution = solve(issue, device)
    reveal = ChallengeReveal(challenge_id=issue.challenge_id, r_seed=secrets.token_hex(16),
                             rows=sorted(secrets.SystemRandom().sample(range(n), proto.OPENED_ROWS)),
                             proof_deadline=0.0)
    proof = answer(solution, reveal, issue.node_id)
    started = time.perf_counter()
    product, opened = proto.decode_proof(proof, n, reveal.rows)
    verdict = proto.check_proof(issue.seed, n, solution.root, reveal.r_seed, product, opened)
    return Rehearsal(issue, solution.seconds, time.perf_counter() - started, verdict.passed, verdict.reason)


# ---------------------------------------------------------------------------------------------------- solver process


class SolverFailed(RuntimeError):
    """The solver process failed: it raised, crashed, was killed, or answered out of turn."""


def solver_command(log_level: str | None = None) -> list[str]:
    """The command line of the solver process. A `python -m` child, not a fork: the daemon is multi-threaded, and
    forking it can deadlock the child (docs/decisions/0002)."""
    if log_level is None:
        name = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        log_level = name if name in ("debug", "info", "warning", "error") else "info"
    return [sys.executable, "-m", SOLVER_MODULE, "--log-level", log_level]


class SolverProcess:
    """The daemon's handle on one solver process: one request at a time over stdin, one JSON reply a line on stdout.

    prepare (the resources) -> ready (the device, warmed up); solve (the issue, give_up_at) -> solved (root, seconds)
    or abandoned; answer (the reveal, node_id) -> proof. Any failure of the child raises SolverFailed here; a child
    that is slower than the give-up deadline is killed and raises ChallengeAbandoned. Use `start_solver`, which
    always stops the child, however the challenge ends."""

    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process
        self.device: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def spawn(cls, command: Sequence[str]) -> SolverProcess:
        # Started from the event loop's thread, which lives as long as the daemon: the child's parent-death signal
        # fires when the thread that started it ends, not only the process. stderr is the daemon's: the child logs
        # there, in the daemon's format.
        try:
            process = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=REPLY_LIMIT,
                env=os.environ | {PARENT_PID_ENV: str(os.getpid())})
        except OSError as e:
            raise SolverFailed(f"cannot start the solver process {list(command)[:3]}: {e}") from None
        return cls(process)

    async def prepare(self, resources: Resources, timeout: float = READY_TIMEOUT) -> str:
        """Import torch, choose the device and warm it up: all before the coordinator's clock starts."""
        try:
            reply = await self._exchange({"op": "prepare", "resources": resources.model_dump(mode="json")},
                                         "ready", timeout, ("device",))
        except TimeoutError:
            raise SolverFailed(f"the solver process (pid {self.pid}) was not ready after {timeout:.0f}s") from None
        self.device = str(reply["device"])
        return self.device

    async def solve(self, issue: ChallengeIssue, give_up_at: float | None) -> tuple[str, float]:
        """The Merkle root of C and the child's own seconds from generation to root. ChallengeAbandoned: the child
        gave up at `give_up_at` (time.monotonic: CLOCK_MONOTONIC is one clock for every process on Linux), or it
        was still busy DEADLINE_MARGIN later (the CUDA path has no point to stop at inside its one matmul) and the
        caller must stop it."""
        started = time.monotonic()
        timeout = None if give_up_at is None else max(0.0, give_up_at - started) + DEADLINE_MARGIN
        try:
            reply = await self._exchange({"op": "solve", "issue": issue.model_dump(mode="json"),
                                          "give_up_at": give_up_at}, "solved", timeout, ("root", "seconds"))
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            raise ChallengeAbandoned(f"gave up after {time.monotonic() - started:.1f}s: the time limit was "
                                     f"{issue.time_limit:.1f}s; the solver process is stopped") from None
        try:
            return str(reply["root"]), float(reply["seconds"])
        except (TypeError, ValueError):
            raise SolverFailed(f"the solver process answered a malformed result: {reply!r:.200}") from None

    async def answer(self, reveal: ChallengeReveal, node_id: str) -> ChallengeProof:
        reply = await self._exchange({"op": "answer", "reveal": reveal.model_dump(mode="json"), "node_id": node_id},
                                     "proof", None, ("proof",))
        try:
            return ChallengeProof.model_validate(reply["proof"])
        except ValueError as e:
            raise SolverFailed(f"the solver process answered a malformed proof: {e}") from None

    async def _exchange(self, request: dict, expected: str, timeout: float | None, fields: tuple[str, ...]) -> dict:
        stdin = self.process.stdin
        if stdin is None or self.process.returncode is not None:
            raise SolverFailed(self._exit_reason())
        try:
            stdin.write(json.dumps(request, allow_nan=False).encode() + b"\n")
            await stdin.drain()
        except ConnectionError:  # the child is gone: its exit status says why (below)
            pass
        async with asyncio.timeout(timeout):
            reply = await self._reply()
        event = reply.get("event")
        if event == expected and all(key in reply for key in fields):
            return reply
        if event == "abandoned":
            raise ChallengeAbandoned(str(reply.get("reason", "the solver gave up")))
        if event == "failed":
            raise SolverFailed(f"the solver process failed: {reply.get('error', 'no reason given')}")
        raise SolverFailed(f"the solver process answered {reply!r:.200} to {request['op']!r}")

    async def _reply(self) -> dict:
        stdout = self.process.stdout
        if stdout is None:
            raise SolverFailed("the solver process has no output pipe")
        while True:
            try:
                line = await stdout.readline()
            except ValueError:  # longer than REPLY_LIMIT
                raise SolverFailed("the solver process sent a reply line over the size limit") from None
            if not line:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.process.wait(), EXIT_TIMEOUT)
                raise SolverFailed(self._exit_reason())
            try:
                reply = json.loads(line)
            except ValueError:
                reply = None
            if isinstance(reply, dict):
                return reply
            logger.debug("ignoring a line from the solver process: %.200r", line)

    def _exit_reason(self) -> str:
        code = self.process.returncode
        if code is None:
            return f"the solver process (pid {self.pid}) closed its output"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the solver process (pid {self.pid}) was killed by {name}"
        return f"the solver process (pid {self.pid}) exited with code {code}"

    async def stop(self, *, politely: bool = True) -> None:
        """Bounded. Politely: close its stdin (an idle solver then exits) and wait a little; then SIGTERM, wait, and
        SIGKILL. A busy solver (cancelled, past its deadline) skips the polite part: it reads nothing while it
        computes."""
        process = self.process
        if process.stdin is not None:
            process.stdin.close()
        if process.returncode is None and politely:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), EXIT_TIMEOUT)
        for send in (process.terminate, process.kill):
            if process.returncode is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                send()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), EXIT_TIMEOUT)
        if process.returncode is None:
            logger.error("the solver process (pid %d) survived SIGKILL for %.0fs", process.pid, EXIT_TIMEOUT)


@contextlib.asynccontextmanager
async def start_solver(resources: Resources, command: Sequence[str] | None = None,
                       ready_timeout: float = READY_TIMEOUT) -> AsyncIterator[SolverProcess]:
    """A solver process, warmed up for `resources`' device, and stopped (its GPU memory freed) when the block ends:
    politely when the block ends normally, at once when it raises or is cancelled."""
    solver = await SolverProcess.spawn(command or solver_command())
    politely = False
    try:
        await solver.prepare(resources, ready_timeout)
        yield solver
        politely = True
    except SolverFailed:
        politely = True  # it said it failed, or it is gone: either way it is not computing
        raise
    finally:
        if not politely and solver.process.returncode is None:
            # SIGTERM before any await: a second cancellation during `stop` cannot leave the child computing.
            with contextlib.suppress(ProcessLookupError):
                solver.process.terminate()
        await solver.stop(politely=politely)


def solver_main(argv: list[str] | None = None) -> int:
    """The solver process: requests from the daemon on stdin, one JSON reply a line on stdout. Exits when stdin
    closes, after the proof, after giving up, or on the first failure (a "failed" reply, exit code 1)."""
    parser = argparse.ArgumentParser(prog=f"python -m {SOLVER_MODULE}")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    die_with_parent()  # first: SIGTERM when the daemon dies (PR_SET_PDEATHSIG), so no solver outlives it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the daemon, which stops this process
    # Replies get a private copy of stdout; fd 1 becomes stderr, so a stray print (ours, torch's, a C library's)
    # can never be taken for a reply.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    logs.configure(args.log_level, os.environ.get(logs.FORMAT_ENV, "text"), "challenge")

    def reply(event: str, **fields) -> None:
        replies.write(json.dumps({"event": event, **fields}, allow_nan=False) + "\n")
        replies.flush()

    device, solution = "cpu", None
    for line in iter(sys.stdin.buffer.readline, b""):
        request: object = None
        try:
            request = json.loads(line)
            op = request.get("op") if isinstance(request, dict) else None
            if op == "prepare":
                device = choose_device(Resources.model_validate(request["resources"]))
                warm_up(device)
                reply("ready", device=device)
            elif op == "solve":
                issue = ChallengeIssue.model_validate(request["issue"])
                try:
                    solution = solve(issue, device, give_up_at=request.get("give_up_at"))
                except ChallengeAbandoned as e:
                    reply("abandoned", reason=str(e))
                    return 0
                reply("solved", root=solution.root, seconds=solution.seconds)
                release_device_memory(device)  # after the reply: outside the timed window
            elif op == "answer":
                if solution is None:
                    raise RuntimeError("asked for an answer before solving")
                proof = answer(solution, ChallengeReveal.model_validate(request["reveal"]), request["node_id"])
                reply("proof", proof=proof.model_dump(mode="json"))
                return 0
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as e:
            logger.exception("the challenge solver failed (%.40r)", request.get("op") if isinstance(request, dict)
                             else request)
            reply("failed", error=f"{type(e).__name__}: {e}"[:2000])
            return 1
    return 0


def release_device_memory(device: str) -> None:
    """Give the caching allocator's blocks back while the solver waits for the reveal (the process's exit frees
    the rest, the CUDA context included)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- the task


class Challenger:
    """Runs at most one challenge at a time in the background, when the coordinator asks for one, each in a fresh
    solver process (`start_solver`)."""

    def __init__(self, client, resources: Resources, node_id: str, *, give_up: bool = True,
                 solver_command: Sequence[str] | None = None):
        self.client, self.resources, self.node_id, self.give_up = client, resources, node_id, give_up
        self.solver_command = solver_command  # None: `python -m gpuswarm.node.challenge`
        self.solver: SolverProcess | None = None  # the running challenge's solver process
        self._task: asyncio.Task | None = None
        self.last_result: ChallengeResult | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def on_heartbeat(self, response: object) -> None:
        """Start a challenge when the heartbeat's answer (a HeartbeatAnswer, or its JSON) asks for one and none is
        running."""
        if isinstance(response, HeartbeatAnswer):
            response = response.model_dump()
        if isinstance(response, dict) and response.get("challenge") is True and not self.running:
            self._task = asyncio.create_task(self._run_logged(), name="gpu-challenge")

    async def _run_logged(self) -> None:
        try:
            await self.run_once()
        except asyncio.CancelledError:
            raise
        except CoordinatorUnavailable as e:
            logger.warning("GPU challenge interrupted: %s; the coordinator will ask again", e)
        except Rejected as e:
            logger.error("GPU challenge refused by the coordinator: %s", e)
        except Exception:
            logger.exception("GPU challenge failed on this node")

    async def run_once(self) -> ChallengeResult | None:
        """One challenge from start to result. Returns the result, or None if the solver gave up or failed (the
        coordinator then records a failure when the time limit passes)."""
        try:
            async with start_solver(self.resources, self.solver_command) as solver:
                self.solver = solver
                return await self._challenge(solver)
        except SolverFailed as e:
            logger.error("GPU challenge failed on this node: %s", e)
            return None
        finally:
            self.solver = None

    async def _challenge(self, solver: SolverProcess) -> ChallengeResult | None:
        # The solver is warmed up: the coordinator's clock starts only now, as it did with an in-process solver.
        issue = await self.client.challenge_start()
        received = time.monotonic()
        logger.info("GPU challenge %s: n=%d on %s (solver pid %d), class %s, %.1fs to commit", issue.challenge_id,
                    issue.n, solver.device, solver.pid, issue.device_class, issue.time_limit)
        give_up_at = received + issue.time_limit + GIVE_UP_GRACE if self.give_up else None
        try:
            root, seconds = await solver.solve(issue, give_up_at)
        except ChallengeAbandoned as e:  # the solver has stopped, or was told to (SIGTERM)
            logger.warning("GPU challenge %s abandoned: %s", issue.challenge_id, e)
            return None
        reply = await self.client.challenge_commit(ChallengeCommit(
            challenge_id=issue.challenge_id, node_id=self.node_id, root=root, compute_seconds=round(seconds, 6)))
        if reply.result is not None:
            result = reply.result
        else:
            proof = await solver.answer(reply.reveal, self.node_id)  # then the solver exits, freeing its memory
            result = await self.client.challenge_proof(proof)
        self.last_result = result
        if result.passed:
            logger.info("GPU challenge %s passed: %.2fs of %.2fs allowed (%.0f GFLOPS measured)",
                        result.challenge_id, result.seconds or 0.0, result.time_limit, result.measured_gflops or 0.0)
        else:
            logger.warning("GPU challenge %s failed: %s", result.challenge_id, result.reason)
        return result

    async def stop(self) -> None:
        """Bounded: cancel the task; its solver process is terminated (then killed) on the way out."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
                async with asyncio.timeout(STOP_TIMEOUT):
                    await self._task


if __name__ == "__main__":
    exit_code = solver_main()
    logging.shutdown()
    sys.stderr.flush()
    # Every reply is flushed and nothing is left to clean up: skip the interpreter's teardown, which takes seconds
    # with torch loaded on a busy host. The kernel frees the memory and the driver the CUDA context.
    os._exit(exit_code)
