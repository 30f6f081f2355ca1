"""The node's GPU-challenge solver on this machine's CPU (torch), and the background task's rules. The solver
process that runs it for the daemon has its own tests (test_challenge_child.py). The CUDA path needs a GPU and is
not run here."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from gpuswarm.client.api import CoordinatorUnavailable
from gpuswarm.node.challenge import ChallengeAbandoned, Challenger, answer, choose_device, solve
from gpuswarm.proto import challenge as ch
from gpuswarm.proto.challenge import ChallengeIssue, ChallengeReveal
from gpuswarm.proto.models import Resources

N = 512
WAIT_STEPS = 1200  # of 0.05 s: each challenge first starts a solver process, which imports torch (slow when loaded)


def issue(n: int = N) -> ChallengeIssue:
    return ChallengeIssue(challenge_id="c-0123456789abcdef", node_id="0123456789abcdef", seed="5e" * 16, n=n,
                          device_class="CPU (2 cores)", time_limit=5.0, issued_at=0.0, deadline=5.0)


def test_the_cpu_solver_computes_the_exact_product_and_its_answer_checks_out():
    solution = solve(issue())
    a, b = ch.matrix(issue().seed, ch.MATRIX_A, N), ch.matrix(issue().seed, ch.MATRIX_B, N)
    assert np.array_equal(solution.product.astype(np.int64), a.astype(np.int64) @ b.astype(np.int64))
    assert solution.root == ch.merkle_levels([ch.leaf_hash(r) for r in solution.product])[-1][0].hex()

    reveal = ChallengeReveal(challenge_id=issue().challenge_id, r_seed="77" * 16, rows=[0, 5, 511],
                             proof_deadline=0.0)
    proof = answer(solution, reveal, issue().node_id)
    product, opened = ch.decode_proof(proof, N, reveal.rows)
    assert ch.check_proof(issue().seed, N, solution.root, reveal.r_seed, product, opened).passed


def test_the_solver_gives_up_past_its_deadline_and_when_cancelled():
    with pytest.raises(ChallengeAbandoned, match="gave up"):
        solve(issue(), give_up_at=time.monotonic() - 1)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ChallengeAbandoned, match="cancelled"):
        solve(issue(), cancel=cancel)


def test_a_cpu_node_computes_on_the_cpu():
    assert choose_device(Resources(cpu_cores=2, ram_gb=4)) == "cpu"


class UnreachableCoordinator:
    def __init__(self):
        self.starts = 0

    async def challenge_start(self):
        self.starts += 1
        raise CoordinatorUnavailable("down")


async def test_the_challenger_starts_only_when_asked_and_never_raises():
    client = UnreachableCoordinator()
    challenger = Challenger(client, Resources(cpu_cores=2, ram_gb=4), "0123456789abcdef")
    for answer_ in (None, {"ok": True}, {"challenge": False}, {"challenge": "yes"}, "challenge"):
        challenger.on_heartbeat(answer_)
        assert not challenger.running
    challenger.on_heartbeat({"ok": True, "challenge": True})
    assert challenger.running
    challenger.on_heartbeat({"ok": True, "challenge": True})  # one at a time
    for _ in range(WAIT_STEPS):
        if not challenger.running:
            break
        await asyncio.sleep(0.05)
    assert client.starts == 1 and not challenger.running  # the failure was logged, not raised
    await challenger.stop()


class AskingCoordinator(UnreachableCoordinator):
    async def heartbeat(self, heartbeat):
        from gpuswarm.proto.api import HeartbeatAnswer

        return HeartbeatAnswer(server_time=0.0, challenge=True)  # what the real client returns


async def test_the_daemon_starts_a_challenge_when_its_heartbeat_answer_asks(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from gpuswarm.node.daemon import NodeConfig, NodeDaemon
    from gpuswarm.node.identity import Identity

    client = AskingCoordinator()
    daemon = NodeDaemon(NodeConfig("http://127.0.0.1:9", tmp_path), Identity(Ed25519PrivateKey.generate()),
                        Resources(cpu_cores=2, ram_gb=4), client)
    daemon.registered = True
    await daemon._heartbeat()  # returns at once: the challenge runs in the background
    assert daemon.challenger.running
    for _ in range(WAIT_STEPS):
        if not daemon.challenger.running:
            break
        await asyncio.sleep(0.05)
    assert client.starts == 1 and daemon.reachable  # its failure did not touch the daemon's loop
    await daemon.challenger.stop()
