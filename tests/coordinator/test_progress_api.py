"""A job's progress history over the real API: points from signed heartbeats (one per step), GET .../progress
(after, truncation, errors, owners), and the TensorBoard event file stored when the job settles, read back with
tensorboardX's protos and an independent TFRecord/CRC-32C reader.

Real aiohttp app over real HTTP, a real database (every backend of the `database_url` fixture), real Ed25519; the
CLI test runs `gpuswarm job download --tensorboard` against the same server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import struct
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.client.api import SyncClient
from gpuswarm.client.jobcli import job_app
from gpuswarm.coordinator import tensorboard
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import SESSIONS, CoordinatorConfig
from gpuswarm.coordinator.db import Job, JobProgress
from sqlalchemy import func, insert, select
from tensorboardX.proto.event_pb2 import Event
from test_api import (
    UNKNOWN_JOB,
    SharedServerClient,
    artifact_request,
    new_owner_token,
    register,
    rejected,
    signed,
    submit,
    wait_for_assignment,
)
from typer.testing import CliRunner

TB = tensorboard.ARTIFACT_NAME


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "coordinator"


@pytest.fixture
async def server(data_dir, database_url):
    app = create_app(CoordinatorConfig(data_dir=data_dir, database_url=database_url, start_dht=False,
                                       loop_interval=0.2, settle_grace=0.5))
    async with TestServer(app) as server:
        yield server


async def owner_client(server: TestServer, name: str) -> tuple[TestClient, str]:
    token = await new_owner_token(server, server.app, name, 100.0)
    client = SharedServerClient(server, headers={"Authorization": f"Bearer {token}"})
    await client.start_server()
    return client, token


@pytest.fixture
async def alice(server):
    client, token = await owner_client(server, "alice")
    client.token = token
    yield client
    await client.close()


@pytest.fixture
async def bob(server):
    client, _ = await owner_client(server, "bob")
    yield client
    await client.close()


@pytest.fixture
async def pair(alice):
    """Two nodes running one 2-node job of alice's."""
    a, b = await register(alice), await register(alice)
    job_id = await submit(alice, min_nodes=2, max_nodes=2, budget=10.0)
    await wait_for_assignment(alice, a, job_id)
    await wait_for_assignment(alice, b, job_id)
    return a, b, job_id


def progress(job_id: str, step: int, **values) -> dict:
    return {"job_id": job_id, "epoch": step / 4, "global_step": step, "loss": round(2.0 / (step + 1), 4),
            "accuracy": min(1.0, 0.1 + step / 20), "samples_per_second": 100.0 + step, "peers": 2} | values


async def beat(client: TestClient, node, *reports: dict) -> None:
    body = signed(node, "heartbeat", {"node_id": node.node_id, "state": "training", "progress": list(reports)})
    response = await client.post("/v1/nodes/heartbeat", json=body)
    assert response.status == 200, await response.text()


async def get(client: TestClient, path: str) -> dict:
    response = await client.get(path)
    assert response.status == 200, await response.text()
    return await response.json()


def steps(body: dict) -> list[int]:
    return [p["global_step"] for p in body["points"]]


async def wait_settled(client: TestClient, job_id: str) -> None:
    for _ in range(100):
        if (await get(client, f"/v1/jobs/{job_id}/statement"))["settled"]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} was not settled")


# ---------------------------------------------------------------------------------------------------- event files


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: independent of the writer's table-driven one."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(data: bytes) -> list[Event]:
    """TFRecords: u64 length, masked CRC-32C of the length, the data, masked CRC-32C of the data (little-endian)."""
    events, offset = [], 0
    while offset < len(data):
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack_from("<I", data, offset + 8)
        payload = data[offset + 12:offset + 12 + length]
        (payload_crc,) = struct.unpack_from("<I", data, offset + 12 + length)
        assert header_crc == masked_crc(header) and payload_crc == masked_crc(payload), f"bad CRC at {offset}"
        events.append(Event.FromString(payload))
        offset += 16 + length
    assert offset == len(data), "trailing bytes after the last record"
    return events


def assert_events_match(data: bytes, points: list[dict]) -> None:
    version, *events = read_events(data)
    assert version.file_version == "brain.Event:2"
    assert [e.step for e in events] == [p["global_step"] for p in points]
    for event, point in zip(events, points, strict=True):
        assert event.wall_time == point["at"]
        scalars = {v.tag: v.simple_value for v in event.summary.value}
        expected = {tag: point[tag] for tag in tensorboard.SCALARS if point[tag] is not None}
        assert set(scalars) == set(expected)
        for tag, value in expected.items():  # simple_value is a float32
            assert scalars[tag] == pytest.approx(value, rel=1e-6), tag


def test_the_crc_reference_is_right():
    assert crc32c(b"123456789") == 0xE3069283  # RFC 3720's check value


# ---------------------------------------------------------------------------------------------------- history


async def test_points_appear_once_per_advancing_step(alice, pair):
    a, b, job_id = pair
    assert (await get(alice, f"/v1/jobs/{job_id}/progress")) == {"job_id": job_id, "state": "running", "points": [],
                                                                   "truncated": False}
    await beat(alice, a, progress(job_id, 0))  # the job's first point, although the step did not move
    await beat(alice, b, progress(job_id, 0, loss=9.0))  # the same step again: no second point
    await beat(alice, b, progress(job_id, 1, loss=0.7))
    await beat(alice, a, progress(job_id, 1, loss=0.8))
    await beat(alice, a, progress(job_id, 0))  # behind the job: ignored
    # Several members reporting a new step in one batch still make one point, the first report's.
    await asyncio.gather(*(beat(alice, n, progress(job_id, 3, peers=i)) for i, n in enumerate([a, b, a, b])))
    await beat(alice, b, progress(job_id, 4, loss=None, accuracy=None))

    body = await get(alice, f"/v1/jobs/{job_id}/progress")
    assert body["job_id"] == job_id and body["state"] == "running" and body["truncated"] is False
    assert steps(body) == [0, 1, 3, 4]
    by_step = {p["global_step"]: p for p in body["points"]}
    assert set(by_step[0]) == {"at", "epoch", "global_step", "loss", "accuracy", "samples_per_second", "peers",
                               "metrics"}
    assert by_step[0]["loss"] == progress(job_id, 0)["loss"] and by_step[1]["loss"] == 0.7
    assert by_step[1]["epoch"] == 0.25 and by_step[1]["samples_per_second"] == 101.0 and by_step[1]["peers"] == 2
    assert by_step[4]["loss"] is None and by_step[4]["accuracy"] is None
    ats = [p["at"] for p in body["points"]]
    assert ats == sorted(ats) and time.time() - 60 < ats[0]
    async with alice.app[SESSIONS]() as session:  # and nothing beyond what the API shows
        assert await session.scalar(select(func.count()).select_from(JobProgress)) == 4

    detail = await get(alice, f"/v1/jobs/{job_id}")  # the latest progress is still the job's
    assert detail["progress"]["global_step"] == 4

    assert steps(await get(alice, f"/v1/jobs/{job_id}/progress?after=0")) == [1, 3, 4]
    assert steps(await get(alice, f"/v1/jobs/{job_id}/progress?after=3")) == [4]
    assert steps(await get(alice, f"/v1/jobs/{job_id}/progress?after=4")) == []
    assert steps(await get(alice, f"/v1/jobs/{job_id}/progress?after=2")) == [3, 4]

    response = await alice.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status == 200
    await beat(alice, a, progress(job_id, 9))  # an ended job takes no more points
    body = await get(alice, f"/v1/jobs/{job_id}/progress")
    assert body["state"] == "cancelled" and steps(body) == [0, 1, 3, 4]


async def test_progress_runs_ahead_of_the_attested_rounds_by_at_most_a_margin(alice, pair):
    """A member once put a job at step 2**53, and honest progress was ignored from then on."""
    from gpuswarm.coordinator.heartbeats import PROGRESS_MARGIN
    from test_api import claim, round_report

    a, b, job_id = pair
    await beat(alice, a, progress(job_id, 2**53))
    await beat(alice, a, progress(job_id, PROGRESS_MARGIN + 1))
    assert steps(await get(alice, f"/v1/jobs/{job_id}/progress")) == []
    await beat(alice, b, progress(job_id, 3))  # honest progress still moves the job
    # Rounds attested up to epoch 20: the job may now move up to 20 + the margin.
    claims = [claim(n, job_id, 20) for n in (a, b)]
    response = await alice.post("/v1/rounds", json=round_report(b, job_id, claims[::-1], epoch=20))
    assert response.status == 201, await response.text()
    await beat(alice, b, progress(job_id, 20 + PROGRESS_MARGIN))
    await beat(alice, a, progress(job_id, 2**53))
    assert steps(await get(alice, f"/v1/jobs/{job_id}/progress")) == [3, 20 + PROGRESS_MARGIN]


async def test_a_lone_members_own_solo_rounds_lift_the_ceiling_and_not_while_others_train(alice, pair):
    """A lone sweep trial of one-batch sync steps once ended with no point at all: its solo rounds counted only
    once credited, and the ledger credits them only after hivemind's records, read every 5 s, show the epoch (here
    they show epoch 0, so nothing is credited)."""
    from gpuswarm.coordinator.heartbeats import PROGRESS_MARGIN
    from test_api import claim, round_report

    a, b, pair_job = pair
    lone = await register(alice)
    job_id = await submit(alice, min_nodes=1, max_nodes=1)
    await wait_for_assignment(alice, lone, job_id)
    async with alice.app[SESSIONS].begin() as session:  # hivemind's records, as last read, show epoch 0
        for job in (job_id, pair_job):
            (await session.get(Job, job)).dht_epoch = 0
    for node, job in ((lone, job_id), (a, pair_job)):
        ended_now = claim(node, job, 40, window_start=time.time() - 5, window_end=time.time())  # b trained in it
        response = await alice.post("/v1/rounds", json=round_report(node, job, [ended_now], epoch=40, solo=True))
        assert response.status == 201, await response.text()
    await beat(alice, lone, progress(job_id, 40 + PROGRESS_MARGIN + 1))  # past its own rounds: still refused
    await beat(alice, lone, progress(job_id, 40 + PROGRESS_MARGIN))
    await beat(alice, a, progress(pair_job, 40))  # b trains too: a's own solo round is not the swarm's
    assert steps(await get(alice, f"/v1/jobs/{job_id}/progress")) == [40 + PROGRESS_MARGIN]
    assert steps(await get(alice, f"/v1/jobs/{pair_job}/progress")) == []


async def test_a_node_outside_the_job_adds_no_point(alice, pair):
    _, _, job_id = pair
    stranger = await register(alice)
    await beat(alice, stranger, progress(job_id, 5))
    assert (await get(alice, f"/v1/jobs/{job_id}/progress"))["points"] == []


@pytest.mark.parametrize("after", ["-1", "abc", "1.5", "", "1e3", " 1", "0x10", "9007199254740993",
                                   "99999999999999999999999", "١"])
async def test_a_bad_after_is_400(alice, after):
    job_id = await submit(alice, min_nodes=2, max_nodes=2)
    error = await rejected(alice, "GET", f"/v1/jobs/{job_id}/progress", 400, "bad_request", params={"after": after})
    assert "after must be a global step" in error["message"]


async def test_progress_of_another_owners_job_is_403_and_of_an_unknown_job_404(server, alice, bob):
    job_id = await submit(alice, min_nodes=2, max_nodes=2)
    await rejected(bob, "GET", f"/v1/jobs/{job_id}/progress", 403, "not_your_job")
    await rejected(bob, "GET", f"/v1/jobs/{job_id}/artifacts/{TB}", 403, "not_your_job")
    await rejected(alice, "GET", f"/v1/jobs/{UNKNOWN_JOB}/progress", 404, "unknown_job")
    await rejected(alice, "GET", "/v1/jobs/nope/progress?after=1", 404, "unknown_job")
    async with SharedServerClient(server) as anonymous:
        await rejected(anonymous, "GET", f"/v1/jobs/{job_id}/progress", 401, "no_token")


async def test_at_most_5000_points_a_page_oldest_first_and_truncated_says_more_follow(alice):
    job_id = await submit(alice, min_nodes=2, max_nodes=2)
    now = time.time()
    async with alice.app[SESSIONS].begin() as session:  # one executemany: 5003 heartbeats would take minutes
        await session.execute(insert(JobProgress), [
            {"job_id": job_id, "at": now + step, "epoch": step / 10, "global_step": step, "loss": None,
             "accuracy": None, "samples_per_second": 1.0, "peers": 1} for step in range(5003)])
    body = await get(alice, f"/v1/jobs/{job_id}/progress")
    assert body["truncated"] is True and steps(body) == list(range(5000))
    body = await get(alice, f"/v1/jobs/{job_id}/progress?after=4999")  # the next page
    assert body["truncated"] is False and steps(body) == [5000, 5001, 5002]
    body = await get(alice, f"/v1/jobs/{job_id}/progress?after=2")
    assert body["truncated"] is False and len(body["points"]) == 5000


# ---------------------------------------------------------------------------------------------------- TensorBoard


async def test_a_settled_job_has_a_tensorboard_file_of_its_points(alice, pair, data_dir):
    a, b, job_id = pair
    for step, node in [(0, a), (1, b), (2, a), (5, b)]:
        await beat(alice, node, progress(job_id, step, accuracy=None if step == 2 else 0.5 + step / 20))
    points = (await get(alice, f"/v1/jobs/{job_id}/progress"))["points"]

    live = await alice.get(f"/v1/jobs/{job_id}/artifacts/{TB}")  # while it runs: rendered on demand
    assert live.status == 200
    data = await live.read()
    assert live.headers["X-Content-SHA256"] == hashlib.sha256(data).hexdigest()
    assert_events_match(data, points)
    assert not [p for p in (data_dir / "blobs").rglob("*") if p.is_file()]  # nothing stored yet

    assert (await alice.post(f"/v1/jobs/{job_id}/cancel")).status == 200
    await wait_settled(alice, job_id)
    detail = await get(alice, f"/v1/jobs/{job_id}")
    [artifact] = [x for x in detail["artifacts"] if x["name"] == TB]
    assert artifact["node_id"] is None and artifact["final"] is False
    stored = (data_dir / "blobs" / artifact["sha256"][:2] / artifact["sha256"]).read_bytes()
    assert artifact["size"] == len(stored) and artifact["sha256"] == hashlib.sha256(stored).hexdigest()
    response = await alice.get(f"/v1/jobs/{job_id}/artifacts/{TB}")
    assert response.status == 200 and await response.read() == stored
    assert response.headers["X-Content-SHA256"] == artifact["sha256"]
    assert_events_match(stored, points)


async def test_a_job_without_points_gets_no_file_but_downloads_an_empty_one(alice, data_dir):
    job_id = await submit(alice, min_nodes=2, max_nodes=2)
    assert (await alice.post(f"/v1/jobs/{job_id}/cancel")).status == 200
    await wait_settled(alice, job_id)
    assert (await get(alice, f"/v1/jobs/{job_id}"))["artifacts"] == []
    response = await alice.get(f"/v1/jobs/{job_id}/artifacts/{TB}")
    assert response.status == 200
    assert [e.file_version for e in read_events(await response.read())] == ["brain.Event:2"]


async def test_a_failed_write_is_logged_and_the_job_still_settles(alice, pair, data_dir, caplog):
    a, _, job_id = pair
    await beat(alice, a, progress(job_id, 0), progress(job_id, 1))
    shutil.rmtree(data_dir / "blobs" / "tmp")
    (data_dir / "blobs" / "tmp").write_text("in the way")  # the store's staging directory cannot be made
    caplog.set_level(logging.ERROR, logger="gpuswarm.coordinator.app")
    assert (await alice.post(f"/v1/jobs/{job_id}/cancel")).status == 200
    await wait_settled(alice, job_id)
    assert any(job_id in r.getMessage() and "TensorBoard" in r.getMessage() for r in caplog.records)
    statement = await get(alice, f"/v1/jobs/{job_id}/statement")
    assert statement["escrow"] == 0.0 and statement["refunded"] == 10.0
    assert (await get(alice, f"/v1/jobs/{job_id}"))["artifacts"] == []
    response = await alice.get(f"/v1/jobs/{job_id}/artifacts/{TB}")  # the points are still served
    assert response.status == 200
    assert_events_match(await response.read(), (await get(alice, f"/v1/jobs/{job_id}/progress"))["points"])


async def test_nodes_cannot_upload_the_tensorboard_artifact(alice, pair):
    a, _, job_id = pair
    await rejected(alice, "PUT", f"/v1/jobs/{job_id}/artifacts/{TB}", 403, "reserved_artifact",
                   **artifact_request(a, job_id, b"forged curve", name=TB))


async def test_client_and_cli_fetch_progress_and_the_event_file(alice, pair, tmp_path):
    a, _, job_id = pair
    await beat(alice, a, progress(job_id, 0))
    await beat(alice, a, progress(job_id, 2))
    url = str(alice.make_url("")).rstrip("/")
    client = SyncClient(url, token=alice.token)
    body = (await asyncio.to_thread(client.progress, job_id)).model_dump(mode="json")
    assert steps(body) == [0, 2] and body["state"] == "running"
    assert steps((await asyncio.to_thread(client.progress, job_id, 0)).model_dump(mode="json")) == [2]

    logdir = tmp_path / "tb"
    result = await asyncio.to_thread(CliRunner().invoke, job_app, [
        "download", job_id, "--tensorboard", str(logdir), "--coordinator", url, "--token", alice.token, "--json"])
    assert result.exit_code == 0, result.output
    saved = json.loads(result.output)
    path = logdir / job_id / TB
    assert saved["path"] == str(path) and saved["state"] == "running"
    assert saved["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert_events_match(path.read_bytes(), body["points"])

    conflict = await asyncio.to_thread(CliRunner().invoke, job_app, [
        "download", job_id, "--tensorboard", str(logdir), "--output", str(tmp_path / "m.pt"), "--coordinator", url,
        "--token", alice.token])
    assert conflict.exit_code == 1 and "conflict" in conflict.output
