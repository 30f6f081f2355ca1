"""Where SQLite and PostgreSQL differ, the API must not: each test here runs on both (the `database_url` param).

SQLite stores any integer in any column, any text in a VARCHAR(n), and NUL characters in text; PostgreSQL does
none of these. Inputs the proto models accept must therefore fit the columns, and inputs a column cannot hold
must be refused with a 4xx before they reach the database (the same on both), never end as a 500.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import test_api
from aiohttp.test_utils import TestClient
from test_api import (
    claim,
    job_spec,
    new_identity,
    register,
    registration,
    rejected,
    round_report,
    signed,
)

# test_api's app fixtures, one per database.
client, data_dir, assigned = test_api.client, test_api.data_dir, test_api.assigned

BIG = 2**53  # proto's Count allows up to here; an INTEGER column on PostgreSQL stops at 2**31 - 1


async def heartbeat(client: TestClient, node, **payload) -> dict:
    response = await client.post("/v1/nodes/heartbeat", json=signed(node, "heartbeat", {
        "node_id": node.node_id, "state": "training"} | payload))
    assert response.status == 200, await response.text()
    return await response.json()


async def test_progress_counts_up_to_two_to_the_53_are_kept(client: TestClient, assigned):
    node, job_id = assigned
    # A step is taken only a few epochs past a credited claim: the lone member's solo round for epoch BIG - 1.
    now = time.time()
    solo = claim(node, job_id, BIG - 1, samples=BIG, window_start=now - 2, window_end=now)
    response = await client.post("/v1/rounds", json=round_report(node, job_id, [solo], epoch=BIG - 1, solo=True))
    assert response.status == 201, await response.text()
    await heartbeat(client, node, progress=[{"job_id": job_id, "epoch": 1.5, "global_step": BIG, "samples": BIG}])
    job = await (await client.get(f"/v1/jobs/{job_id}")).json()
    assert job["progress"]["global_step"] == BIG and job["progress"]["epoch"] == 1.5


@pytest.mark.parametrize("field", ["software_version", "endpoints"])
async def test_registration_with_a_nul_character_is_422(client: TestClient, field: str):
    node = new_identity()
    value = "gpuswarm\x00test" if field == "software_version" else ["127.0.0.1\x00"]
    await rejected(client, "POST", "/v1/nodes/register", 422, "nul_character",
                   json=signed(node, "register", registration(node, **{field: value})))


async def test_job_spec_with_a_nul_character_in_its_name_is_422(client: TestClient):
    await rejected(client, "POST", "/v1/jobs", 422, "nul_character", json=job_spec(name="a\x00b"))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32-le"])
async def test_a_nul_character_in_a_utf16_or_utf32_body_is_422(client: TestClient, encoding: str):
    """json.loads takes these encodings too, where the escape's bytes are not the UTF-8 text read_json looks for."""
    body = json.dumps(job_spec(name="a\x00b")).encode(encoding)
    await rejected(client, "POST", "/v1/jobs", 422, "nul_character", data=body,
                   headers={"Content-Type": "application/json"})


async def test_the_text_backslash_u0000_is_no_nul_character(client: TestClient):
    response = await client.post("/v1/jobs", json=job_spec(name="a\\u0000b"))
    assert response.status == 201, await response.text()


async def test_failure_reason_with_a_nul_character_is_422(client: TestClient, assigned):
    node, job_id = assigned
    await rejected(client, "POST", "/v1/nodes/heartbeat", 422, "nul_character", json=signed(node, "heartbeat", {
        "node_id": node.node_id, "state": "idle", "failures": [{"job_id": job_id, "reason": "oom\x00"}]}))


@pytest.mark.parametrize("url", ["/v1/nodes/%00/challenges", "/v1/jobs/j%00", "/v1/jobs?state=%00"])
async def test_a_url_with_a_nul_character_is_422(client: TestClient, url: str):
    # Found by tests/coordinator/test_fuzz_api.py: PostgreSQL refused the lookup of a node id holding NUL (a 500).
    await rejected(client, "GET", url, 422, "nul_character")


async def test_concurrent_replays_of_one_message_are_accepted_once(client: TestClient):
    node = await register(client)
    body = json.dumps(signed(node, "heartbeat", {"node_id": node.node_id, "state": "idle"}))
    responses = await asyncio.gather(*(client.post("/v1/nodes/heartbeat", data=body,
                                                   headers={"Content-Type": "application/json"})
                                       for _ in range(4)))
    assert sorted(r.status for r in responses) == [200, 409, 409, 409], [r.status for r in responses]


async def test_text_at_the_models_longest_fits_its_column(client: TestClient):
    """PostgreSQL enforces VARCHAR(n) (in characters), SQLite does not: the models' limits must fit the columns."""
    node = new_identity()
    response = await client.post("/v1/nodes/register", json=signed(node, "register", registration(
        node, software_version="é" * 128, endpoints=["ü" * 128] * 16)))
    assert response.status == 200, await response.text()
    response = await client.post("/v1/jobs", json=job_spec(name="名" * 128))
    assert response.status == 201, await response.text()
    assert (await response.json())["name"] == "名" * 128
