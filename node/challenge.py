"""The node's side of the GPU challenge: the solver (torch) and the task that takes a challenge when asked.

Owns computing C = A @ B for a `proto.challenge.ChallengeIssue` on the device the node claims (CUDA when it
claims a GPU and torch sees one, else the CPU), committing to C's rows, and answering the reveal. The coordinator
asks through the heartbeat answer (`"challenge": true`); `Challenger.on_heartbeat` then runs one challenge in the
background. The matrix work runs in a worker thread, so the daemon's event loop (heartbeats, training supervision)
never waits on it, and a failed challenge is logged, never raised into the supervisor loop.

The CUDA path has not been run on a GPU in this project's CI (no GPU there); the CPU path is what the tests run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
from gpuswarm.client.api import CoordinatorUnavailable, Rejected
from gpuswarm.proto import challenge as proto
from gpuswarm.proto.api import HeartbeatAnswer
from gpuswarm.proto.challenge import (
    ChallengeCommit,
    ChallengeIssue,
    ChallengeProof,
    ChallengeResult,
    ChallengeReveal,
    OpenedRow,
)
from gpuswarm.proto.models import Resources

logger = logging.getLogger(__name__)
CPU_ROW_BLOCK = 64  # rows of C per CPU matmul (divides GEN_BLOCK): between them the solver checks its deadline
GIVE_UP_GRACE = 2.0  # seconds past the time limit (own clock) after which an unfinished product is abandoned
STOP_TIMEOUT = 5.0


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


class Challenger:
    """Runs at most one challenge at a time in the background, when the coordinator asks for one."""

    def __init__(self, client, resources: Resources, node_id: str, *, give_up: bool = True):
        self.client, self.resources, self.node_id, self.give_up = client, resources, node_id, give_up
        self._task: asyncio.Task | None = None
        self._cancel = threading.Event()
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
        """One challenge from start to result. Returns the result, or None if the solver gave up (the coordinator
        then records a failure when the time limit passes)."""
        device = await asyncio.to_thread(choose_device, self.resources)
        await asyncio.to_thread(warm_up, device)
        issue = await self.client.challenge_start()
        received = time.monotonic()
        logger.info("GPU challenge %s: n=%d on %s, class %s, %.1fs to commit", issue.challenge_id, issue.n, device,
                    issue.device_class, issue.time_limit)
        give_up_at = received + issue.time_limit + GIVE_UP_GRACE if self.give_up else None
        try:
            solution = await asyncio.to_thread(solve, issue, device, give_up_at=give_up_at, cancel=self._cancel)
        except ChallengeAbandoned as e:
            logger.warning("GPU challenge %s abandoned: %s", issue.challenge_id, e)
            return None
        reply = await self.client.challenge_commit(ChallengeCommit(
            challenge_id=issue.challenge_id, node_id=self.node_id, root=solution.root,
            compute_seconds=round(solution.seconds, 6)))
        if reply.result is not None:
            result = reply.result
        else:
            proof = await asyncio.to_thread(answer, solution, reply.reveal, self.node_id)
            del solution
            result = await self.client.challenge_proof(proof)
        self.last_result = result
        if result.passed:
            logger.info("GPU challenge %s passed: %.2fs of %.2fs allowed (%.0f GFLOPS measured)",
                        result.challenge_id, result.seconds or 0.0, result.time_limit, result.measured_gflops or 0.0)
        else:
            logger.warning("GPU challenge %s failed: %s", result.challenge_id, result.reason)
        return result

    async def stop(self) -> None:
        """Bounded: tell the solver thread to stop at its next block, cancel the task, wait a little."""
        self._cancel.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
                await asyncio.wait_for(self._task, timeout=STOP_TIMEOUT)
