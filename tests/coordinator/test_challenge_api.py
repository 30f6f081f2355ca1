"""The GPU challenge over the real API: the real aiohttp app over real HTTP, real SQLite and PostgreSQL (the
`database_url` fixture), real signatures, and the node's real solver (torch on this machine's CPU).

An honest CPU node passes and is verified; a node that claims an H100 and computes on this CPU misses the time
bound and is unverified; every refused request gets a 4xx in the API's error shape and leaves every table as it
was (test_api.py's `rejected` checks that).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.client.api import CoordinatorClient
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.challenge import COMMIT_GRACE
from gpuswarm.coordinator.challenge_schedule import challenge_due
from gpuswarm.coordinator.config import CONFIG, CoordinatorConfig
from gpuswarm.coordinator.db import Node
from gpuswarm.node.challenge import Challenger, answer, solve
from gpuswarm.node.identity import Identity
from gpuswarm.proto import challenge as ch
from gpuswarm.proto.challenge import ChallengeIssue, ChallengeReveal
from gpuswarm.proto.models import Resources
from test_api import new_identity, rejected, signed

H100 = {"gpus": [{"model": "NVIDIA H100 80GB HBM3", "memory_gb": 80.0}], "cpu_cores": 2, "ram_gb": 24.0}
CPU = {"gpus": [], "cpu_cores": 4, "ram_gb": 8.0}


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "coordinator"


@contextlib.asynccontextmanager
async def serve(data_dir: Path, database_url: str | None, **config) -> AsyncIterator[TestClient]:
    app = create_app(CoordinatorConfig(data_dir=data_dir, database_url=database_url, start_dht=False,
                                       loop_interval=0.2, **config))
    async with TestServer(app) as server, TestClient(server) as client:
        yield client


@pytest.fixture
async def client(data_dir: Path, database_url: str | None):
    async with serve(data_dir, database_url) as client:
        yield client


async def register(client: TestClient, resources: dict = CPU, identity: Identity | None = None) -> Identity:
    identity = identity or new_identity()
    payload = {"node_id": identity.node_id, "resources": resources, "software_version": "gpuswarm-test",
               "endpoints": ["127.0.0.1"]}
    response = await client.post("/v1/nodes/register", json=signed(identity, "register", payload))
    assert response.status == 200, await response.text()
    return identity


async def heartbeat(client: TestClient, identity: Identity) -> dict:
    response = await client.post("/v1/nodes/heartbeat",
                                 json=signed(identity, "heartbeat", {"node_id": identity.node_id, "state": "idle"}))
    assert response.status == 200, await response.text()
    return await response.json()


async def standing(client: TestClient, identity: Identity) -> dict:
    response = await client.get(f"/v1/nodes/{identity.node_id}/challenges")
    assert response.status == 200, await response.text()
    return await response.json()


async def start(client: TestClient, identity: Identity) -> ChallengeIssue:
    response = await client.post("/v1/challenges", json=signed(identity, ch.START_KIND,
                                                               {"node_id": identity.node_id}))
    assert response.status == 201, await response.text()
    return ChallengeIssue.model_validate(await response.json())


def commit_body(identity: Identity, challenge_id: str, root: str) -> dict:
    return signed(identity, ch.COMMIT_KIND, {"challenge_id": challenge_id, "node_id": identity.node_id, "root": root})


async def commit(client: TestClient, identity: Identity, challenge_id: str, root: str) -> dict:
    response = await client.post(f"/v1/challenges/{challenge_id}/commit", json=commit_body(identity, challenge_id,
                                                                                           root))
    assert response.status == 200, await response.text()
    return await response.json()


def node_client(client: TestClient, identity: Identity) -> CoordinatorClient:
    return CoordinatorClient(str(client.server.make_url("")), identity, timeout=60.0)


# ---------------------------------------------------------------------------------------------------- honest


async def test_registration_asks_for_a_challenge_through_the_heartbeat(client: TestClient):
    node = await register(client)
    assert (await heartbeat(client, node))["challenge"] is True
    before = await standing(client, node)
    assert before["verified"] is False and before["challenges"] == []
    assert before["next_challenge_at"] <= time.time()


async def test_an_honest_cpu_node_passes_and_is_verified(client: TestClient):
    node = await register(client)
    async with node_client(client, node) as coordinator:
        result = await Challenger(coordinator, Resources.model_validate(CPU), node.node_id).run_once()
    assert result is not None and result.passed, result
    assert result.verified and result.n == ch.CPU_N and result.device_class == "CPU (4 cores)"
    assert 0 < result.seconds < result.time_limit and result.measured_gflops > 0

    after = await standing(client, node)
    assert after["verified"] is True and after["challenges_passed"] == 1 and after["challenges_failed"] == 0
    assert after["measured_gflops"] == pytest.approx(result.measured_gflops)
    assert after["last_challenge_at"] is not None
    assert after["next_challenge_at"] >= after["last_challenge_at"] + client.app[CONFIG].challenge_min_interval
    assert [c["state"] for c in after["challenges"]] == ["passed"]
    assert (await heartbeat(client, node))["challenge"] is False  # the next one is a random while away
    nodes = (await (await client.get("/v1/nodes")).json())["nodes"]
    assert [n["verified"] for n in nodes] == [True]


async def test_a_node_is_challenged_again_at_random_times(data_dir: Path, database_url: str | None):
    async with serve(data_dir, database_url, challenge_mean_interval=0.3, challenge_min_interval=0.0) as client:
        node = await register(client)
        async with node_client(client, node) as coordinator:
            challenger = Challenger(coordinator, Resources.model_validate(CPU), node.node_id)
            assert (await challenger.run_once()).passed
            deadline = time.monotonic() + 10
            while not (await heartbeat(client, node))["challenge"]:
                assert time.monotonic() < deadline, "the coordinator never asked again"
                await asyncio.sleep(0.1)
            assert (await challenger.run_once()).passed
        after = await standing(client, node)
        assert after["challenges_passed"] == 2 and after["verified"] is True


# ---------------------------------------------------------------------------------------------------- cheaters


async def test_a_node_claiming_an_h100_it_lacks_fails_the_time_bound(client: TestClient):
    """The node claims an H100 and really computes, on this CPU. The H100 class gets n = 16384 (8.8 TFLOP) and
    under 5 s to commit; this machine's 2 cores need about a minute, so the node gives up at its deadline and the
    coordinator fails the challenge when the bound (plus grace) has passed."""
    node = await register(client, H100)
    assert (await heartbeat(client, node))["challenge"] is True
    async with node_client(client, node) as coordinator:
        challenger = Challenger(coordinator, Resources.model_validate(H100), node.node_id)
        assert await challenger.run_once() is None  # gave up: the product was not done in time
    challenge = (await standing(client, node))["challenges"][0]
    assert challenge["device_class"] == "NVIDIA H100 SXM" and challenge["n"] == ch.GPU_N
    assert challenge["time_limit"] < 6.0

    deadline = time.monotonic() + challenge["time_limit"] + COMMIT_GRACE + 10
    while (after := await standing(client, node))["challenges"][0]["state"] == "issued":
        assert time.monotonic() < deadline, "the sweep never failed the unanswered challenge"
        await asyncio.sleep(0.2)
    assert after["verified"] is False and after["challenges_failed"] == 1 and after["challenges_passed"] == 0
    assert after["challenges"][0]["state"] == "failed"
    assert "no commitment within the time limit" in after["challenges"][0]["reason"]
    nodes = (await (await client.get("/v1/nodes")).json())["nodes"]
    assert [n["verified"] for n in nodes] == [False]


async def test_a_late_commitment_fails_at_once(client: TestClient):
    node = await register(client)
    issue = await start(client, node)
    await asyncio.sleep(issue.time_limit + 0.2)
    reply = await commit(client, node, issue.challenge_id, "ab" * 32)
    assert reply["reveal"] is None and reply["result"]["passed"] is False
    assert reply["result"]["reason"].startswith("late: committed after")
    assert reply["result"]["seconds"] > issue.time_limit and reply["result"]["verified"] is False
    assert (await standing(client, node))["challenges_failed"] == 1
    # A second commitment to a late one is refused as such (not "closed"), and changes nothing.
    await rejected(client, "POST", f"/v1/challenges/{issue.challenge_id}/commit", 409, "already_committed",
                   json=commit_body(node, issue.challenge_id, "cd" * 32))
    assert (await standing(client, node))["challenges_failed"] == 1


async def test_the_shortcut_without_the_product_fails_and_unverifies_a_verified_node(data_dir, database_url):
    """A verified node later commits without computing C and answers C·r as A·(B·r): the openings fail it."""
    # No gap: the next challenge is due as soon as the first ends (a random gap made this test flaky).
    async with serve(data_dir, database_url, challenge_mean_interval=0.0, challenge_min_interval=0.0) as client:
        node = await register(client)
        async with node_client(client, node) as coordinator:
            assert (await Challenger(coordinator, Resources.model_validate(CPU), node.node_id).run_once()).passed
        issue = await start(client, node)
        garbage = np.zeros((issue.n, issue.n), dtype=np.int16)
        levels = ch.merkle_levels([ch.leaf_hash(row) for row in garbage])
        reveal = ChallengeReveal.model_validate((await commit(client, node, issue.challenge_id,
                                                              levels[-1][0].hex()))["reveal"])
        r = ch.reveal_vector(reveal.r_seed, issue.n)
        shortcut = ch.generated_times(issue.seed, ch.MATRIX_A, issue.n,
                                      ch.generated_times(issue.seed, ch.MATRIX_B, issue.n, r))
        proof = {"challenge_id": issue.challenge_id, "node_id": node.node_id,
                 "product": ch.encode_ints(shortcut, ch.VECTOR_DTYPE),
                 "rows": [{"index": i, "values": ch.encode_ints(garbage[i], ch.ROW_DTYPE),
                           "path": [h.hex() for h in ch.merkle_path(levels, i)]} for i in reveal.rows]}
        response = await client.post(f"/v1/challenges/{issue.challenge_id}/proof",
                                     json=signed(node, ch.PROOF_KIND, proof))
        assert response.status == 200, await response.text()
        result = await response.json()
        assert result["passed"] is False and "is not row" in result["reason"] and result["verified"] is False
        after = await standing(client, node)
        assert after["verified"] is False and after["challenges_passed"] == 1 and after["challenges_failed"] == 1


async def test_a_node_that_commits_but_never_proves_fails(data_dir: Path, database_url: str | None):
    async with serve(data_dir, database_url, challenge_proof_timeout=0.5) as client:
        node = await register(client)
        issue = await start(client, node)
        solution = await asyncio.to_thread(solve, issue)
        assert (await commit(client, node, issue.challenge_id, solution.root))["reveal"] is not None
        deadline = time.monotonic() + 10
        while (after := await standing(client, node))["challenges"][0]["state"] == "revealed":
            assert time.monotonic() < deadline, "the sweep never failed the unproved challenge"
            await asyncio.sleep(0.1)
        assert after["challenges"][0]["state"] == "failed" and after["verified"] is False
        assert after["challenges"][0]["reason"].startswith("no proof within")
        assert after["measured_gflops"] > 0  # the commitment was in time and measured


async def test_a_restarted_node_abandons_its_open_challenge(client: TestClient):
    node = await register(client)
    first = await start(client, node)
    assert (await heartbeat(client, node))["challenge"] is False  # one is open
    second = await start(client, node)
    assert second.challenge_id != first.challenge_id
    states = {c["id"]: (c["state"], c["reason"]) for c in (await standing(client, node))["challenges"]}
    assert states[first.challenge_id] == ("failed", "abandoned: the node started another challenge")
    assert states[second.challenge_id][0] == "issued"
    # The abandoned one, never committed to, takes no commitment now.
    await rejected(client, "POST", f"/v1/challenges/{first.challenge_id}/commit", 409, "challenge_closed",
                   json=commit_body(node, first.challenge_id, "ab" * 32))


async def test_re_registering_with_a_new_device_unverifies(client: TestClient):
    node = await register(client)
    async with node_client(client, node) as coordinator:
        assert (await Challenger(coordinator, Resources.model_validate(CPU), node.node_id).run_once()).passed
    await register(client, CPU, node)  # same claim: still verified
    assert (await standing(client, node))["verified"] is True
    await register(client, H100, node)  # a new claim: unverified until it passes for it
    assert (await standing(client, node))["verified"] is False


def test_a_busy_node_is_not_asked():
    node = Node(id="0" * 16, next_challenge_at=100.0)
    assert challenge_due(node, 100.0, busy=False)
    assert not challenge_due(node, 100.0, busy=True)
    assert not challenge_due(node, 99.0, busy=False)
    assert not challenge_due(Node(id="0" * 16, next_challenge_at=None), 100.0, busy=False)  # one is open


# ---------------------------------------------------------------------------------------------------- bad input


async def test_bad_start_requests_are_refused_and_change_nothing(client: TestClient):
    await rejected(client, "POST", "/v1/challenges", 400, "malformed_json", data=b"{not json")
    stranger = new_identity()
    await rejected(client, "POST", "/v1/challenges", 404, "unknown_node",
                   json=signed(stranger, ch.START_KIND, {"node_id": stranger.node_id}))
    node = await register(client)
    other = new_identity()
    await rejected(client, "POST", "/v1/challenges", 401, "bad_signature",
                   json=signed(other, ch.START_KIND, {"node_id": node.node_id}))
    await rejected(client, "POST", "/v1/challenges", 401, "bad_signature",
                   json=signed(node, "heartbeat", {"node_id": node.node_id}))  # another kind
    body = signed(node, ch.START_KIND, {"node_id": node.node_id})
    assert (await client.post("/v1/challenges", json=body)).status == 201
    await rejected(client, "POST", "/v1/challenges", 409, "replay", json=body)


async def test_a_node_with_nothing_due_cannot_start(client: TestClient):
    node = await register(client)
    async with node_client(client, node) as coordinator:
        assert (await Challenger(coordinator, Resources.model_validate(CPU), node.node_id).run_once()).passed
    await rejected(client, "POST", "/v1/challenges", 409, "not_due",
                   json=signed(node, ch.START_KIND, {"node_id": node.node_id}))


async def test_bad_commitments_are_refused_and_change_nothing(client: TestClient):
    node, other = await register(client), await register(client)
    issue = await start(client, node)
    path = f"/v1/challenges/{issue.challenge_id}/commit"
    await rejected(client, "POST", path, 400, "malformed_json", data=b"[")
    await rejected(client, "POST", path, 422, "invalid", json=signed(node, ch.COMMIT_KIND, {
        "challenge_id": issue.challenge_id, "node_id": node.node_id, "root": "not a digest"}))
    unknown = "c-0000000000000000"
    await rejected(client, "POST", f"/v1/challenges/{unknown}/commit", 404, "unknown_challenge",
                   json=commit_body(node, unknown, "ab" * 32))
    await rejected(client, "POST", path, 400, "challenge_mismatch", json=commit_body(node, unknown, "ab" * 32))
    await rejected(client, "POST", path, 403, "not_your_challenge",
                   json=commit_body(other, issue.challenge_id, "ab" * 32))  # the wrong node
    # The reveal is refused before a commitment: a proof now is "not committed".
    await rejected(client, "POST", f"/v1/challenges/{issue.challenge_id}/proof", 409, "not_committed",
                   json=signed(node, ch.PROOF_KIND, {"challenge_id": issue.challenge_id, "node_id": node.node_id,
                                                     "product": "", "rows": []}))

    solution = await asyncio.to_thread(solve, issue)
    body = commit_body(node, issue.challenge_id, solution.root)
    assert (await client.post(path, json=body)).status == 200
    await rejected(client, "POST", path, 409, "replay", json=body)  # the same commitment again
    await rejected(client, "POST", path, 409, "already_committed",
                   json=commit_body(node, issue.challenge_id, "cd" * 32))  # a second, freshly signed one


async def test_bad_proofs_are_refused_and_change_nothing_and_the_good_one_still_passes(client: TestClient):
    node, other = await register(client), await register(client)
    issue = await start(client, node)
    solution = await asyncio.to_thread(solve, issue)
    reveal = ChallengeReveal.model_validate((await commit(client, node, issue.challenge_id, solution.root))["reveal"])
    assert len(reveal.rows) == ch.OPENED_ROWS and reveal.rows == sorted(set(reveal.rows))
    proof = answer(solution, reveal, node.node_id).model_dump(mode="json")
    path = f"/v1/challenges/{issue.challenge_id}/proof"

    await rejected(client, "POST", path, 400, "malformed_json", data=b"{")
    await rejected(client, "POST", path, 413, "payload_too_large", data=b" " * (ch.MAX_PROOF_BYTES + 1))
    await rejected(client, "POST", path, 403, "not_your_challenge",
                   json=signed(other, ch.PROOF_KIND, proof | {"node_id": other.node_id}))
    await rejected(client, "POST", path, 422, "bad_proof",
                   json=signed(node, ch.PROOF_KIND, proof | {"rows": proof["rows"][:-1]}))
    await rejected(client, "POST", path, 422, "bad_proof",
                   json=signed(node, ch.PROOF_KIND, proof | {"product": proof["product"][:-12]}))
    await rejected(client, "POST", path, 422, "invalid",
                   json=signed(node, ch.PROOF_KIND, proof | {"rows": "nope"}))

    body = signed(node, ch.PROOF_KIND, proof)
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()
    result = await response.json()
    assert result["passed"] is True and result["verified"] is True, result
    await rejected(client, "POST", path, 409, "replay", json=body)
    await rejected(client, "POST", path, 409, "challenge_closed", json=signed(node, ch.PROOF_KIND, proof))
    await rejected(client, "POST", f"/v1/challenges/{issue.challenge_id}/commit", 409, "already_committed",
                   json=commit_body(node, issue.challenge_id, solution.root))


async def test_a_proof_body_may_exceed_the_json_cap(client: TestClient):
    """The proof route has its own cap: a large proof (here padded) is read, not refused at 64 KiB."""
    node = await register(client)
    issue = await start(client, node)
    solution = await asyncio.to_thread(solve, issue)
    reveal = ChallengeReveal.model_validate((await commit(client, node, issue.challenge_id, solution.root))["reveal"])
    body = signed(node, ch.PROOF_KIND, answer(solution, reveal, node.node_id).model_dump(mode="json"))
    raw = json.dumps(body).encode() + b" " * (client.app[CONFIG].max_json_bytes * 2)
    response = await client.post(f"/v1/challenges/{issue.challenge_id}/proof", data=raw,
                                 headers={"Content-Type": "application/json"})
    assert response.status == 200, await response.text()
    assert (await response.json())["passed"] is True
