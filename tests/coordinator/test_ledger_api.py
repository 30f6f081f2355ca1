"""The marketplace's money and trust over the real API: owner accounts and isolation, escrow, peer-attested
claims (credit, equivocation, throughput cap, solo rounds), settlement, statements and reputation.

Real aiohttp app over real HTTP, a real database (every backend of the `database_url` fixture), real Ed25519.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, CoordinatorConfig
from test_api import (
    SharedServerClient,
    claim,
    new_owner_token,
    register,
    rejected,
    round_report,
    signed,
    submit,
    wait_for_assignment,
)

PRICE_A, PRICE_B = 1.0, 2.0


@pytest.fixture
async def server(tmp_path, database_url):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", database_url=database_url,
                                       start_dht=False, loop_interval=0.2, settle_grace=0.5))
    async with TestServer(app) as server:
        yield server


@pytest.fixture
async def admin(server):
    async with SharedServerClient(server, headers={"Authorization": f"Bearer {server.app[ADMIN_TOKEN]}"}) as client:
        yield client


async def owner_client(server, name: str, credits: float = 100.0) -> TestClient:
    token = await new_owner_token(server, server.app, name, credits)
    client = SharedServerClient(server, headers={"Authorization": f"Bearer {token}"})
    await client.start_server()
    return client


@pytest.fixture
async def alice(server):
    client = await owner_client(server, "alice")
    yield client
    await client.close()


@pytest.fixture
async def bob(server):
    client = await owner_client(server, "bob")
    yield client
    await client.close()


async def register_priced(client: TestClient, price: float):
    from test_api import new_identity, registration

    node = new_identity()
    response = await client.post("/v1/nodes/register",
                                 json=signed(node, "register", registration(node, price_per_gpu_hour=price)))
    assert response.status == 200, await response.text()
    return node


@pytest.fixture
async def pair(alice):
    """Two nodes (asks 1.0 and 2.0) running one 2-node job of alice's with a budget of 10."""
    a, b = await register_priced(alice, PRICE_A), await register_priced(alice, PRICE_B)
    job_id = await submit(alice, min_nodes=2, max_nodes=2, budget=10.0, max_price_per_gpu_hour=5.0)
    await wait_for_assignment(alice, a, job_id)
    await wait_for_assignment(alice, b, job_id)
    return a, b, job_id


async def get(client: TestClient, path: str) -> dict:
    response = await client.get(path)
    assert response.status == 200, await response.text()
    return await response.json()


async def report(client: TestClient, node, job_id: str, claims: list[dict], epoch: int = 0, solo: bool = False):
    response = await client.post("/v1/rounds", json=round_report(node, job_id, claims, epoch=epoch, solo=solo))
    assert response.status == 201, await response.text()
    return await response.json()


async def wait_settled(client: TestClient, job_id: str) -> dict:
    for _ in range(100):
        statement = await get(client, f"/v1/jobs/{job_id}/statement")
        if statement["settled"]:
            return statement
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} was not settled: {statement}")


def rows(statement: dict) -> dict[str, dict]:
    return {r["node_id"]: r for r in statement["nodes"]}


# ---------------------------------------------------------------------------------------------------- accounts


async def test_owner_sees_and_cancels_only_their_own_jobs(alice, bob):
    job_id = await submit(alice)
    assert [j["id"] for j in (await get(alice, "/v1/jobs"))["jobs"]] == [job_id]
    assert (await get(bob, "/v1/jobs"))["jobs"] == []
    for method, path in [("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/contributions"),
                         ("GET", f"/v1/jobs/{job_id}/statement"), ("POST", f"/v1/jobs/{job_id}/cancel"),
                         ("GET", f"/v1/jobs/{job_id}/artifacts/model.pt")]:
        await rejected(bob, method, path, 403, "not_your_job")
    assert (await get(alice, f"/v1/jobs/{job_id}"))["state"] in ("pending", "running")


async def test_job_routes_need_a_valid_owner_token(server, alice):
    job_id = await submit(alice)
    async with SharedServerClient(server) as anonymous:
        await rejected(anonymous, "GET", "/v1/jobs", 401, "no_token")
        await rejected(anonymous, "POST", "/v1/jobs", 401, "no_token", json={"workload": "digits-mlp"})
        await rejected(anonymous, "GET", f"/v1/jobs/{job_id}", 401, "no_token")
    async with SharedServerClient(server, headers={"Authorization": "Bearer gso_not-a-real-token"}) as forged:
        await rejected(forged, "GET", "/v1/jobs", 401, "bad_token")
        await rejected(forged, "POST", f"/v1/jobs/{job_id}/cancel", 401, "bad_token")


async def test_only_the_admin_creates_owners_and_adjusts_credits(alice, admin):
    await rejected(alice, "POST", "/v1/owners", 401, "admin_only", json={"name": "mallory", "credits": 1e6})
    me = await get(alice, "/v1/owners/me")
    await rejected(alice, "POST", f"/v1/owners/{me['id']}/credits", 401, "admin_only", json={"amount": 1e6})
    await rejected(admin, "POST", "/v1/owners", 409, "owner_exists", json={"name": "alice"})
    await rejected(admin, "POST", "/v1/owners", 422, "invalid", json={"name": "bad name!", "credits": 1})
    await rejected(admin, "POST", "/v1/owners", 422, "invalid", json={"name": "nan", "credits": "NaN"})
    await rejected(admin, "POST", f"/v1/owners/{me['id']}/credits", 409, "insufficient_funds",
                   json={"amount": -1000.5})
    await rejected(admin, "POST", "/v1/owners/o-000000000000/credits", 404, "unknown_owner", json={"amount": 1})
    response = await admin.post(f"/v1/owners/{me['id']}/credits", json={"amount": 25.5, "memo": "top-up"})
    assert response.status == 200, await response.text()
    assert (await response.json())["balance"] == 125.5
    assert (await get(alice, "/v1/owners/me"))["balance"] == 125.5


async def test_a_budget_over_the_balance_is_refused_and_changes_nothing(alice):
    await rejected(alice, "POST", "/v1/jobs", 402, "insufficient_funds",
                   json={"workload": "digits-mlp", "budget": 100.01})


# ---------------------------------------------------------------------------------------------------- escrow


async def test_attested_claims_are_paid_from_escrow_and_the_rest_refunded(alice, pair):
    a, b, job_id = pair
    assert (await get(alice, "/v1/owners/me"))["balance"] == 90.0  # 10 reserved at start
    await asyncio.sleep(0.5)  # the paid time starts when a node joined the job
    now = time.time()
    window = {"window_start": now - 40, "window_end": now}
    ca = claim(a, job_id, 0, samples=300, compute_seconds=36.0, **window)
    cb = claim(b, job_id, 0, samples=280, compute_seconds=30.0, **window)
    first = await report(alice, a, job_id, [ca, cb])
    assert {c["node_id"]: c["status"] for c in first["claims"]} == {a.node_id: "pending", b.node_id: "credited"}
    second = await report(alice, b, job_id, [cb, ca])
    assert {c["status"] for c in second["claims"]} == {"credited"}
    again = await report(alice, b, job_id, [cb, ca])  # a resent report (new nonce) pays nothing twice
    assert {c["status"] for c in again["claims"]} == {"credited"}

    response = await alice.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status == 200
    statement = await wait_settled(alice, job_id)
    by_node = rows(statement)
    assert by_node[a.node_id]["samples"] == 300 and by_node[b.node_id]["samples"] == 280
    # Paid wall-clock time: from joining the job (not from the claimed window start, 40 s ago) to the claim.
    seconds_a, seconds_b = by_node[a.node_id]["compute_seconds"], by_node[b.node_id]["compute_seconds"]
    assert 0.4 < seconds_a < 5 and 0.4 < seconds_b < 5, by_node
    paid_a, paid_b = seconds_a / 3600 * PRICE_A, seconds_b / 3600 * PRICE_B
    assert by_node[a.node_id]["paid"] == pytest.approx(paid_a, abs=2e-6)
    assert by_node[b.node_id]["paid"] == pytest.approx(paid_b, abs=2e-6)
    assert statement["reserved"] == 10.0
    assert statement["paid"] == pytest.approx(paid_a + paid_b, abs=4e-6)
    assert statement["refunded"] == pytest.approx(10.0 - statement["paid"], abs=1e-6)
    assert statement["escrow"] == 0.0
    assert (await get(alice, "/v1/owners/me"))["balance"] == pytest.approx(100.0 - statement["paid"], abs=1e-6)
    node_statement = await get(alice, f"/v1/nodes/{b.node_id}/statement")
    assert node_statement["balance"] == by_node[b.node_id]["paid"]
    assert node_statement["jobs"][0]["job_id"] == job_id


async def test_a_job_whose_budget_runs_out_ends(alice):
    a, b = await register_priced(alice, 1000.0), await register_priced(alice, 1000.0)
    job_id = await submit(alice, min_nodes=2, max_nodes=2, budget=0.001)
    await wait_for_assignment(alice, a, job_id)
    await asyncio.sleep(0.2)
    now = time.time()
    ca, cb = (claim(n, job_id, 0, compute_seconds=30.0, window_start=now - 40, window_end=now) for n in (a, b))
    await report(alice, a, job_id, [ca, cb])
    job = await get(alice, f"/v1/jobs/{job_id}")
    assert job["state"] == "failed" and "budget" in job["error"]
    statement = await wait_settled(alice, job_id)
    assert statement["paid"] == pytest.approx(0.001) and statement["refunded"] == 0.0


# ---------------------------------------------------------------------------------------------------- attestation


async def test_a_claim_nobody_else_attests_is_never_credited(alice, pair):
    a, b, job_id = pair
    result = await report(alice, a, job_id, [claim(a, job_id, 0)])  # not solo, and no peer reported it
    assert result["claims"][0]["status"] == "pending"
    now = time.time()
    solo = await report(alice, a, job_id, [claim(a, job_id, 1, window_start=now - 30, window_end=now)],
                        epoch=1, solo=True)  # b was in the job during this window
    assert solo["claims"][0]["status"] == "pending"
    await alice.post(f"/v1/jobs/{job_id}/cancel")
    statement = await wait_settled(alice, job_id)
    row = rows(statement)[a.node_id]
    # Both rejected and unpaid; neither flagged (a round that failed, solo or after its group formed, is not a lie).
    assert (row["claims"], row["samples"], row["paid"], row["flagged"], row["pending"]) == (2, 0, 0.0, 0, 0)


async def test_equivocation_is_flagged_and_only_the_attested_version_counts(alice, pair):
    a, b, job_id = pair
    shared = claim(a, job_id, 0, samples=100)  # what a showed its round
    inflated = claim(a, job_id, 0, samples=900)  # what a told the coordinator
    await report(alice, a, job_id, [inflated, claim(b, job_id, 0)])
    await report(alice, b, job_id, [claim(b, job_id, 0), shared])
    await alice.post(f"/v1/jobs/{job_id}/cancel")
    row = rows(await wait_settled(alice, job_id))[a.node_id]
    assert (row["claims"], row["claimed_samples"], row["samples"], row["flagged"]) == (2, 1000, 100, 2)


async def test_a_restarted_node_claiming_its_epoch_again_later_is_not_an_equivocation(alice, pair):
    """A node that restarts re-enters the epoch it left: a second claim for that epoch, over a later window, is
    a retry. One of the two is credited, neither is flagged."""
    a, b, job_id = pair
    now = time.time()
    before = claim(a, job_id, 0, samples=100, window_start=now - 60, window_end=now - 50)
    after = claim(a, job_id, 0, samples=40, window_start=now - 20, window_end=now - 10)
    await report(alice, a, job_id, [before, claim(b, job_id, 0)])
    await report(alice, b, job_id, [claim(b, job_id, 0), before])
    await report(alice, a, job_id, [after])
    await alice.post(f"/v1/jobs/{job_id}/cancel")
    row = rows(await wait_settled(alice, job_id))[a.node_id]
    assert (row["claims"], row["claimed_samples"], row["samples"], row["flagged"]) == (2, 140, 100, 0)


async def test_a_claim_beyond_measured_throughput_is_capped_and_flagged(alice, pair):
    a, b, job_id = pair
    now = time.time()
    window = {"window_start": now - 30, "window_end": now}
    for epoch in (0, 1):
        honest = claim(a, job_id, epoch, samples=600, **window)
        liar = claim(b, job_id, epoch, samples=6000, **window)  # ten times its peer's share of the same round
        await report(alice, a, job_id, [honest, liar])
        await report(alice, b, job_id, [liar, honest])
        statement = await get(alice, f"/v1/jobs/{job_id}/statement")
        by_node = rows(statement)
        assert by_node[a.node_id]["samples"] == 600 * (epoch + 1) and by_node[a.node_id]["flagged"] == 0
        # Its first round capped at 3x its peer's share, unflagged (the first round's shares depend on when each
        # member started); from its second, flagged and credited the peer's share alone: no slack for a liar.
        assert by_node[b.node_id]["samples"] == [1800, 1800 + 600][epoch] and by_node[b.node_id]["flagged"] == epoch
    # Paid for the fraction of its window its credit supports: inflating earned it less than honesty.
    assert by_node[b.node_id]["paid"] < by_node[a.node_id]["paid"]
    nodes = {n["id"]: n for n in (await get(alice, "/v1/nodes"))["nodes"]}
    assert nodes[b.node_id]["reputation"] < nodes[a.node_id]["reputation"]


async def test_the_round_in_which_a_member_joins_caps_but_flags_no_one(alice):
    """The round in which a member joins says nothing about honesty: the joiner steps once after loading the state,
    the peer that served it steps little meanwhile, and the third steps on (seen in the SIGTERM fault test: 510
    samples against 96 and 32, the honest one flagged). Its claims are capped, no one is flagged; the same claim in
    the next round, the joiner in since the last, is flagged."""
    a, b = await register_priced(alice, PRICE_A), await register_priced(alice, PRICE_A)
    job_id = await submit(alice, min_nodes=2, max_nodes=3, budget=10.0, max_price_per_gpu_hour=5.0)
    for n in (a, b):
        await wait_for_assignment(alice, n, job_id)

    async def round_of(epoch: int, samples: dict) -> dict[str, dict]:
        start = time.time()
        await asyncio.sleep(0.3)  # every window inside every member's assignment
        claims = [claim(n, job_id, epoch, samples=k, window_start=start, window_end=time.time())
                  for n, k in samples.items()]
        for i, n in enumerate(samples):
            await report(alice, n, job_id, claims[i:] + claims[:i], epoch=epoch)
        return rows(await get(alice, f"/v1/jobs/{job_id}/statement"))

    first = await round_of(0, {a: 600, b: 600})
    assert first[a.node_id]["samples"] == 600 and first[a.node_id]["flagged"] == 0
    c = await register_priced(alice, PRICE_A)
    await wait_for_assignment(alice, c, job_id)  # the running job grows to max_nodes
    joined = await round_of(1, {a: 6000, b: 100, c: 32})
    assert 600 < joined[a.node_id]["samples"] < 600 + 6000, joined[a.node_id]  # capped
    assert {r["flagged"] for r in joined.values()} == {0}, joined
    after = await round_of(2, {a: 6000, b: 600, c: 600})
    assert after[a.node_id]["flagged"] == 1 and after[b.node_id]["flagged"] == after[c.node_id]["flagged"] == 0


async def test_claims_from_outside_the_job_are_ignored_not_fatal(alice, pair):
    a, b, job_id = pair
    outsider = await register(alice)
    other_job = await submit(alice)
    result = await report(alice, a, job_id, [claim(a, job_id, 0), claim(outsider, job_id, 0),
                                             claim(b, other_job, 0)])
    assert [c["node_id"] for c in result["claims"]] == [a.node_id]
    assert sorted(i["reason"] for i in result["ignored"]) == ["another job", "not a member of this job"]


async def test_node_statement_of_an_unknown_node_is_404(alice):
    await rejected(alice, "GET", "/v1/nodes/0123456789abcdef/statement", 404, "unknown_node")


async def test_openapi_document_lists_every_route_with_its_body_schema(server, alice):
    doc = await get(alice, "/v1/openapi.json")
    assert doc["openapi"].startswith("3.")
    served = {(r.resource.get_info().get("formatter") or r.resource.get_info().get("path"), r.method.lower())
              for r in server.app.router.routes() if r.method != "HEAD"}
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert documented == {(p, m) for p, m in served if p.startswith("/v1/")}
    submit_op = doc["paths"]["/v1/jobs"]["post"]
    assert submit_op["security"] == [{"ownerToken": []}]
    assert submit_op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/JobSpec"}
    assert "budget" in doc["components"]["schemas"]["JobSpec"]["properties"]
    rounds = doc["paths"]["/v1/rounds"]["post"]
    assert "round_report" in rounds["description"] and "RoundReport" in doc["components"]["schemas"]


async def test_a_round_reported_an_hour_late_is_still_credited(alice, pair):
    """Nodes buffer their round reports while the coordinator is down: the report is signed when it is finally
    sent, the claims inside keep their signatures from the round (an hour old here), and are accepted."""
    from gpuswarm.proto import signing
    from gpuswarm.proto.models import CLAIM_KIND

    a, b, job_id = pair
    then = time.time() - 3600
    old = [signing.sign(n.private_key, CLAIM_KIND, claim(n, job_id, 0, window_start=then - 30,
                                                         window_end=then)["payload"], now=then).model_dump(mode="json")
           for n in (a, b)]
    await report(alice, a, job_id, old)
    result = await report(alice, b, job_id, old[::-1])
    assert {c["status"] for c in result["claims"]} == {"credited"}


async def test_claims_for_windows_after_a_cancel_are_not_paid_even_when_attested(alice, pair):
    a, b, job_id = pair
    response = await alice.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status == 200
    cancelled = time.time()
    await asyncio.sleep(0.2)  # the members train on a moment (they learn of the cancel at their next poll)
    window = {"window_start": cancelled + 0.05, "window_end": time.time()}
    ca, cb = claim(a, job_id, 5, **window), claim(b, job_id, 5, **window)
    first = await report(alice, a, job_id, [ca, cb], epoch=5)
    second = await report(alice, b, job_id, [cb, ca], epoch=5)
    assert {c["status"] for c in first["claims"] + second["claims"]} == {"rejected"}
    statement = await wait_settled(alice, job_id)
    assert statement["paid"] == 0.0 and statement["refunded"] == 10.0
    assert {r["flagged"] for r in statement["nodes"]} == {0}  # late work is not a lie, just not the job's


def test_billable_time_is_only_time_inside_the_nodes_assignments():
    from gpuswarm.coordinator.db import Contribution
    from gpuswarm.coordinator.ledger import billable_seconds

    c = Contribution(window_start=100.0, window_end=200.0, received_at=250.0)
    assert billable_seconds(c, -float("inf"), [(0.0, float("inf"))]) == 100.0
    assert billable_seconds(c, -float("inf"), [(120.0, 150.0), (170.0, float("inf"))]) == 60.0  # lost, re-matched
    assert billable_seconds(c, 180.0, [(120.0, 150.0), (170.0, float("inf"))]) == 20.0  # paid up to 180 already
    assert billable_seconds(c, -float("inf"), [(0.0, 90.0)]) == 0.0  # it ended before the window
    assert billable_seconds(c, -float("inf"), []) == 0.0
    late = Contribution(window_start=100.0, window_end=200.0, received_at=150.0)  # the end is cut at receipt
    assert billable_seconds(late, -float("inf"), [(0.0, float("inf"))]) == 50.0


async def test_a_peer_two_members_name_as_an_outlier_is_banned_and_unpaid(alice):
    a, b, c = [await register_priced(alice, 1.0) for _ in range(3)]
    job_id = await submit(alice, min_nodes=3, max_nodes=3, budget=10.0, max_price_per_gpu_hour=5.0)
    for n in (a, b, c):
        await wait_for_assignment(alice, n, job_id)
    await asyncio.sleep(1.2)
    now = time.time()
    def claims_of(epoch: int, start: float, end: float) -> dict:
        return {n.node_id: claim(n, job_id, epoch, peer_id=f"peer-{i}", window_start=start, window_end=end)
                for i, n in enumerate((a, b, c))}

    async def round_of(reporter, suspects, epoch=1):
        mine = claims[epoch]
        body = round_report(reporter, job_id, [mine[reporter.node_id]] + [v for k, v in mine.items()
                                                                          if k != reporter.node_id], epoch=epoch)
        body = signed(reporter, "round_report", body["payload"] | {"suspects": suspects})
        response = await alice.post("/v1/rounds", json=body)
        assert response.status == 201, await response.text()
        return {x["node_id"]: x["status"] for x in (await response.json())["claims"]}

    # Round 0 looked clean to everyone: c is credited and paid for it. Round 1's reducers clip c.
    claims = {0: claims_of(0, now - 1.0, now - 0.5), 1: claims_of(1, now - 0.5, now)}  # after the assignments
    assert (await round_of(a, [], epoch=0))[c.node_id] == "credited"
    paid_before = (await get(alice, f"/v1/nodes/{c.node_id}/statement"))["balance"]
    assert paid_before > 0
    first = await round_of(a, ["peer-2"])
    assert first[c.node_id] == "pending"  # a vouches for b, not for the outlier
    detail = await get(alice, f"/v1/jobs/{job_id}")
    assert {x["node_id"]: x["state"] for x in detail["assignments"]}[c.node_id] == "active"  # one name: no ban
    await round_of(b, ["peer-2", "peer-unknown"])
    await round_of(c, ["peer-0"])  # the outlier names an honest member back: one voice, no ban
    detail = await get(alice, f"/v1/jobs/{job_id}")
    states = {x["node_id"]: x["state"] for x in detail["assignments"]}
    assert states == {a.node_id: "active", b.node_id: "active", c.node_id: "banned"}
    assert any("banned" in e["message"] for e in detail["events"])
    await asyncio.sleep(0.6)  # a few ticks: the matcher does not give the job back to the banned node
    assert {x["node_id"]: x["state"] for x in (await get(alice, f"/v1/jobs/{job_id}"))["assignments"]} == states
    await alice.post(f"/v1/jobs/{job_id}/cancel")
    by_node = rows(await wait_settled(alice, job_id))
    assert by_node[c.node_id]["paid"] == 0.0 and by_node[c.node_id]["flagged"] >= 1
    assert (await get(alice, f"/v1/nodes/{c.node_id}/statement"))["balance"] == 0.0  # round 0's pay forfeited
    assert by_node[a.node_id]["paid"] > 0 and by_node[b.node_id]["paid"] > 0
    assert by_node[a.node_id]["flagged"] == 0 and by_node[b.node_id]["flagged"] == 0
