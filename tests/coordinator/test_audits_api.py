"""Refereed re-execution over the real API (coordinator.audits, views/audits): a credited round is drawn, its node
uploads the evidence, a third node referees it; two failed verdicts ban the node from the job and take back
what it was paid, a pass closes the audit, no evidence in time forfeits the job's pay. Every refused request
(wrong node, wrong state, unknown audit, bad signature, a body that is not the signed size) changes nothing.
The draw and the choice of referee are pure functions with property tests.

Real aiohttp app over real HTTP, both databases, real Ed25519; the nodes are test identities (the node's half,
evidence and replay, is tests/node/test_evidence.py; both together, tests/integration/test_audits.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import pytest
from aiohttp.test_utils import TestServer
from gpuswarm.coordinator import audits
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.audits import can_referee, drawn, pick_referee
from gpuswarm.coordinator.config import SESSIONS, CoordinatorConfig
from gpuswarm.coordinator.db import Audit
from gpuswarm.proto.models import ENVELOPE_HEADER, JobSpec, Resources
from hypothesis import given
from hypothesis import strategies as st
from test_api import claim, new_identity, rejected, signed, submit, wait_for_assignment
from test_ledger_api import get, owner_client, register_priced, report, rows

EVIDENCE = b"a round's evidence: the coordinator stores it and never reads it"


@pytest.fixture
async def server(tmp_path, database_url):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", database_url=database_url,
                                       start_dht=False, loop_interval=0.2, settle_grace=60.0, audit_rate=1.0))
    async with TestServer(app) as server:
        yield server


@pytest.fixture
async def alice(server):
    client = await owner_client(server, "alice")
    yield client
    await client.close()


@pytest.fixture
async def audited(alice):
    """Nodes a and b train alice's 2-node job (mode diloco, the default) and report one round with both claims;
    r1 and r2 are idle, and so the only possible referees. Returns (a, b, r1, r2, job id, a's audit id)."""
    a, b = await register_priced(alice, 1.0), await register_priced(alice, 1.0)
    job_id = await submit(alice, min_nodes=2, max_nodes=2, budget=10.0)
    await wait_for_assignment(alice, a, job_id)
    await wait_for_assignment(alice, b, job_id)
    r1, r2 = await register_priced(alice, 50.0), await register_priced(alice, 50.0)
    await report_a_round(alice, a, b, job_id)
    [request] = await wait_for(lambda: polled(alice, a, "audits"))
    assert request["job_id"] == job_id and request["epoch"] == 0
    return a, b, r1, r2, job_id, request["audit_id"]


async def report_a_round(client, a, b, job_id: str) -> None:
    """a and b report one round of the job, each with both claims, over a window inside their assignments."""
    await asyncio.sleep(1.0)  # a window inside the assignments: paid
    window = {"window_start": time.time() - 0.9, "window_end": time.time()}
    claims = [claim(a, job_id, **window), claim(b, job_id, **window)]
    await report(client, a, job_id, claims)
    await report(client, b, job_id, claims[::-1])


async def polled(client, node, key: str) -> list[dict]:
    response = await client.post("/v1/nodes/assignments", json=signed(node, "poll", {"node_id": node.node_id}))
    assert response.status == 200, await response.text()
    return (await response.json())[key]


async def wait_for(probe, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := await probe():
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"nothing after {timeout}s")


def evidence_upload(node, audit_id: str, data: bytes = EVIDENCE, **overrides) -> dict:
    meta = {"audit_id": audit_id, "node_id": node.node_id, "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data)} | overrides
    return {"headers": {ENVELOPE_HEADER: json.dumps(signed(node, "evidence", meta))}, "data": data}


def verdict(node, audit_id: str, passed: bool, reason: str = "") -> dict:
    return signed(node, "verdict", {"audit_id": audit_id, "node_id": node.node_id, "steps": 20, "samples": 640,
                                    "distance": 0.0 if passed else 1.0, "passed": passed, "reason": reason})


async def upload(client, node, audit_id: str) -> None:
    response = await client.put(f"/v1/audits/{audit_id}/evidence", **evidence_upload(node, audit_id))
    assert response.status == 201, await response.text()
    assert (await response.json())["state"] == "waiting"


async def referee_of(client, audit_id: str, *nodes) -> tuple:
    """The node among `nodes` the coordinator gave the audit to, and its task."""
    async def assigned():
        for node in nodes:
            for task in await polled(client, node, "referee"):
                if task["audit_id"] == audit_id:
                    return node, task
        return None
    return await wait_for(assigned)


async def judge(client, node, audit_id: str, passed: bool) -> str:
    response = await client.post(f"/v1/audits/{audit_id}/verdict",
                                 json=verdict(node, audit_id, passed, "" if passed else "its end lies 1 of the "
                                                                                        "round's movement away"))
    assert response.status == 200, await response.text()
    return (await response.json())["state"]


async def test_two_failed_verdicts_ban_the_node_and_take_back_its_pay(alice, audited):
    a, b, r1, r2, job_id, audit_id = audited
    assert rows(await get(alice, f"/v1/jobs/{job_id}/statement"))[a.node_id]["paid"] > 0
    await upload(alice, a, audit_id)

    first, task = await referee_of(alice, audit_id, r1, r2, a, b)
    assert first in (r1, r2)  # never the node itself nor its round-mate
    assert task["node_id"] == a.node_id and task["evidence_sha256"] == hashlib.sha256(EVIDENCE).hexdigest()
    assert JobSpec.model_validate(task["spec"]).workload == "digits-mlp"
    fetch = signed(first, "fetch_evidence", {"audit_id": audit_id, "node_id": first.node_id})
    response = await alice.get(f"/v1/audits/{audit_id}/evidence", headers={ENVELOPE_HEADER: json.dumps(fetch)})
    assert response.status == 200 and await response.read() == EVIDENCE
    assert await judge(alice, first, audit_id, passed=False) == "waiting"  # one referee alone convicts nobody
    assert rows(await get(alice, f"/v1/jobs/{job_id}/statement"))[a.node_id]["paid"] > 0

    second, _ = await referee_of(alice, audit_id, r1, r2)
    assert second is not first
    assert await judge(alice, second, audit_id, passed=False) == "failed"
    statement = rows(await get(alice, f"/v1/jobs/{job_id}/statement"))
    assert statement[a.node_id]["paid"] == 0 and statement[a.node_id]["flagged"] >= 1  # forfeited to the escrow
    assert statement[b.node_id]["paid"] > 0
    job = await get(alice, f"/v1/jobs/{job_id}")
    assert {x["node_id"]: x["state"] for x in job["assignments"]}[a.node_id] == "banned"
    listed = {x["audit_id"]: x for x in (await get(alice, f"/v1/jobs/{job_id}/audits"))["audits"]}
    assert listed[audit_id]["state"] == "failed" and listed[audit_id]["referees"] == [first.node_id, second.node_id]
    assert any(x["node_id"] == b.node_id for x in listed.values())  # the round-mate must show its evidence too


async def test_a_passed_verdict_closes_the_audit_and_the_pay_stays(alice, audited):
    a, b, r1, r2, job_id, audit_id = audited
    paid = rows(await get(alice, f"/v1/jobs/{job_id}/statement"))[a.node_id]["paid"]
    await upload(alice, a, audit_id)
    referee, _ = await referee_of(alice, audit_id, r1, r2)
    assert await judge(alice, referee, audit_id, passed=True) == "passed"
    assert rows(await get(alice, f"/v1/jobs/{job_id}/statement"))[a.node_id]["paid"] == paid
    assert await polled(alice, referee, "referee") == []


async def test_no_evidence_in_time_forfeits_the_jobs_pay(alice, audited):
    a, b, r1, r2, job_id, audit_id = audited

    async def unanswered():
        listed = (await get(alice, f"/v1/jobs/{job_id}/audits"))["audits"]
        return [x for x in listed if x["state"] == "unanswered"]

    async with alice.app[SESSIONS].begin() as session:  # a's audit is overdue
        (await session.get(Audit, audit_id)).deadline = time.time() - 1
    [gone] = await wait_for(unanswered)
    assert gone["node_id"] == a.node_id and "no evidence" in gone["reason"]
    assert rows(await get(alice, f"/v1/jobs/{job_id}/statement"))[a.node_id]["paid"] == 0


async def test_refused_audit_requests_change_nothing(alice, audited):
    a, b, r1, r2, job_id, audit_id = audited
    path = f"/v1/audits/{audit_id}/evidence"
    stranger = new_identity()
    await rejected(alice, "PUT", path, 403, "not_your_audit", **evidence_upload(b, audit_id))
    await rejected(alice, "PUT", "/v1/audits/a-000000000000/evidence", 404, "unknown_audit",
                   **evidence_upload(a, "a-000000000000"))
    await rejected(alice, "PUT", path, 400, None, **evidence_upload(a, "a-111111111111"))  # URL and header differ
    await rejected(alice, "PUT", path, 400, "digest_mismatch", **evidence_upload(a, audit_id, EVIDENCE,
                                                                                  sha256="0" * 64))
    await rejected(alice, "PUT", path, 401, None, **evidence_upload(stranger, audit_id, node_id=a.node_id))
    await rejected(alice, "POST", f"/v1/audits/{audit_id}/verdict", 403, "not_the_referee",
                   json=verdict(r1, audit_id, passed=True))  # nobody referees an audit without evidence
    await upload(alice, a, audit_id)
    referee, _ = await referee_of(alice, audit_id, r1, r2)  # (the background tick changes nothing after this)
    await rejected(alice, "PUT", path, 409, "audit_state", **evidence_upload(a, audit_id))
    other = r2 if referee is r1 else r1
    await rejected(alice, "POST", f"/v1/audits/{audit_id}/verdict", 403, "not_the_referee",
                   json=verdict(other, audit_id, passed=False))
    fetch = signed(other, "fetch_evidence", {"audit_id": audit_id, "node_id": other.node_id})
    await rejected(alice, "GET", path, 403, "not_the_referee", headers={ENVELOPE_HEADER: json.dumps(fetch)})
    forged = verdict(referee, audit_id, passed=False)
    forged["payload"]["passed"] = True  # the signature no longer covers it
    await rejected(alice, "POST", f"/v1/audits/{audit_id}/verdict", 401, None, json=forged)
    await rejected(alice, "POST", f"/v1/audits/{audit_id}/verdict", 422, None,
                   json=signed(referee, "verdict", {"audit_id": audit_id, "node_id": referee.node_id,
                                                    "passed": "maybe"}))


async def test_a_member_of_the_job_referees_it_only_once_nobody_else_could(alice, monkeypatch):
    """c trains the job but was not in the audited round. It is no referee of the round while the audit is younger
    than MEMBER_REFEREE_AFTER (its re-computation would take the compute the job pays for, and every round waits
    for its slowest member); a node outside the job takes the audit, and c does once the wait is over."""
    a, b, c = [await register_priced(alice, 1.0) for _ in range(3)]
    job_id = await submit(alice, min_nodes=3, max_nodes=3, budget=10.0)
    for node in (a, b, c):
        await wait_for_assignment(alice, node, job_id)
    await report_a_round(alice, a, b, job_id)
    [first] = await wait_for(lambda: polled(alice, a, "audits"))
    [second] = await wait_for(lambda: polled(alice, b, "audits"))
    await upload(alice, a, first["audit_id"])
    await upload(alice, b, second["audit_id"])

    async def beat() -> None:  # c stays online: silent for node_timeout, it would be no candidate at all
        response = await alice.post("/v1/nodes/heartbeat",
                                    json=signed(c, "heartbeat", {"node_id": c.node_id, "state": "training"}))
        assert response.status == 200, await response.text()

    for _ in range(5):  # five ticks of the coordinator's loop with c the only node outside the round
        await beat()
        await asyncio.sleep(0.2)
    assert await polled(alice, c, "referee") == []
    outsider = await register_priced(alice, 50.0)
    [task] = await wait_for(lambda: polled(alice, outsider, "referee"))  # either audit (opened in the same tick)
    assert await polled(alice, c, "referee") == []
    await beat()
    monkeypatch.setattr(audits, "MEMBER_REFEREE_AFTER", 0.0)  # the other audit has now waited long enough
    [other] = {first["audit_id"], second["audit_id"]} - {task["audit_id"]}
    referee, task = await referee_of(alice, other, outsider, c)
    assert referee is c, task  # the outsider referees one round at a time


async def test_nothing_is_audited_at_rate_zero(tmp_path):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "c", start_dht=False, loop_interval=0.2, audit_rate=0.0))
    async with TestServer(app) as server:
        carol = await owner_client(server, "carol")
        a, b = await register_priced(carol, 1.0), await register_priced(carol, 1.0)
        job_id = await submit(carol, min_nodes=2, max_nodes=2, budget=10.0)
        await wait_for_assignment(carol, a, job_id)
        await wait_for_assignment(carol, b, job_id)
        await asyncio.sleep(1.0)
        window = {"window_start": time.time() - 0.9, "window_end": time.time()}
        claims = [claim(a, job_id, **window), claim(b, job_id, **window)]
        await report(carol, a, job_id, claims)
        await report(carol, b, job_id, claims[::-1])
        assert rows(await get(carol, f"/v1/jobs/{job_id}/statement"))[a.node_id]["paid"] > 0
        await asyncio.sleep(1.0)  # five ticks
        assert (await get(carol, f"/v1/jobs/{job_id}/audits"))["audits"] == []
        await carol.close()


# ---------------------------------------------------------------------------------------------------- pure


@given(signatures=st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=30, unique=True),
       rate=st.floats(0, 1), key=st.binary(min_size=1, max_size=32))
def test_the_draw_is_a_fixed_answer_per_claim_and_follows_the_rate(signatures, rate, key):
    picked = [s for s in signatures if drawn(key, s, rate)]
    assert picked == [s for s in signatures if drawn(key, s, rate)]  # asking again changes nothing
    assert all(drawn(key, s, 1.0) for s in signatures) and not any(drawn(key, s, 0.0) for s in signatures)
    assert set(picked) <= {s for s in signatures if drawn(key, s, min(1.0, rate * 2))}  # monotone in the rate


def test_the_draw_picks_about_the_rate():
    picked = sum(drawn(b"k", f"sig-{i}", 0.05) for i in range(20_000))
    assert 800 < picked < 1200


@given(candidates=st.sets(st.text(min_size=1, max_size=8), max_size=10), excluded=st.sets(st.text(max_size=8)),
       draw=st.text(max_size=10))
def test_a_referee_is_never_excluded_and_the_choice_is_stable(candidates, excluded, draw):
    chosen = pick_referee(candidates, excluded, b"key", draw)
    if candidates - excluded:
        assert chosen in candidates - excluded
        assert pick_referee(sorted(candidates, reverse=True), excluded, b"key", draw) == chosen
    else:
        assert chosen is None


def test_only_opted_in_nodes_referee_owners_code_and_gpu_jobs_need_gpus():
    cpu = Resources(cpu_cores=4, ram_gb=8)
    builtin = JobSpec.model_validate({"workload": "digits-mlp"})
    owners = JobSpec.model_validate({"code": {"sha256": "0" * 64, "size": 1, "format": "tar",
                                              "entrypoint": "pkg:Work"}})
    assert can_referee(cpu, builtin) and not can_referee(cpu, owners)
    assert can_referee(cpu.model_copy(update={"custom_code": True}), owners)
    gpu_job = JobSpec.model_validate({"workload": "digits-mlp", "requirements": {"allow_cpu": False}})
    assert not can_referee(cpu, gpu_job)
