"""client.api's blob calls against the real app: an owner uploads and downloads, a node fetches and uploads
checkpoints, with files streamed through temporary files and checked against their SHA-256."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer
from gpuswarm.client.api import ApiError, CoordinatorClient, Rejected
from gpuswarm.coordinator.app import create_app
from test_api import new_identity, registration, signed
from test_blobs import config, owner, wait_for_assignment


@pytest.fixture
async def server(tmp_path: Path, database_url: str | None):
    async with TestServer(create_app(config(tmp_path / "coordinator", database_url))) as server:
        yield server


async def test_owner_and_node_blob_calls(server: TestServer, tmp_path: Path):
    alice = await owner(server, "alice")
    token = alice.session.headers["Authorization"].removeprefix("Bearer ")
    url = str(server.make_url("")).rstrip("/")
    api = CoordinatorClient(url, token=token)

    code = tmp_path / "code.tar"
    code.write_bytes(os.urandom(1000))
    digest, size = hashlib.sha256(code.read_bytes()).hexdigest(), code.stat().st_size
    assert await api.missing_blobs([digest]) == [digest]
    seen: list[int] = []
    stored = await api.upload_blob(code, digest, size, progress=seen.append)
    assert stored.sha256 == digest and stored.size == size and seen[-1] == size
    assert await api.missing_blobs([digest]) == []
    assert await api.download_blob(digest, tmp_path / "back.tar") == digest
    assert (tmp_path / "back.tar").read_bytes() == code.read_bytes()
    with pytest.raises(Rejected) as refused:
        await api.upload_blob(code, "0" * 64, size)
    assert refused.value.code == "digest_mismatch"

    job = await api.submit_job({"code": {"sha256": digest, "size": size, "format": "tar",
                                         "entrypoint": "train:workload"}, "stop": {"max_steps": 5}})
    node = new_identity()
    body = registration(node, resources={"gpus": [], "cpu_cores": 2, "ram_gb": 4.0, "custom_code": True})
    assert (await alice.post("/v1/nodes/register", json=signed(node, "register", body))).status == 200
    await wait_for_assignment(alice, node, job.id)

    async with CoordinatorClient(url, node) as node_api:
        dest = tmp_path / "node" / "code.tar"
        dest.parent.mkdir()
        fetched: list[int] = []
        assert await node_api.fetch_blob(job.id, digest, dest, progress=fetched.append) == digest
        assert dest.read_bytes() == code.read_bytes() and fetched[-1] == size
        assert os.listdir(dest.parent) == ["code.tar"]  # no temporary file left
        with pytest.raises(Rejected) as refused:
            await node_api.fetch_blob(job.id, "1" * 64, tmp_path / "node" / "x")
        assert refused.value.code == "not_a_job_blob" and not (tmp_path / "node" / "x").exists()

        checkpoint = tmp_path / "state.pt"
        checkpoint.write_bytes(b"optimizer and model state")
        answer = await node_api.upload(job.id, checkpoint, final=False, checkpoint_step=7, name="ckpt-7.pt")
        assert answer.name == "ckpt-7.pt"
        [assignment] = await node_api.assignments()
        assert assignment.checkpoint is not None and assignment.checkpoint.step == 7
        model = tmp_path / "model.pt"
        model.write_bytes(b"final")
        await node_api.upload(job.id, model, final=True, accuracy=0.5, metrics={"val_bpb": 1.9})

    [ckpt, final] = await api.artifacts(job.id)
    assert (ckpt.name, ckpt.checkpoint_step) == ("ckpt-7.pt", 7)
    assert final.final and final.metrics == {"val_bpb": 1.9}
    assert (await api.job(job.id)).final_metrics == {"val_bpb": 1.9}
    await alice.close()


async def test_a_corrupt_download_leaves_no_file(server: TestServer, tmp_path: Path, monkeypatch):
    alice = await owner(server, "alice")
    token = alice.session.headers["Authorization"].removeprefix("Bearer ")
    api = CoordinatorClient(str(server.make_url("")).rstrip("/"), token=token)
    data = tmp_path / "data.bin"
    data.write_bytes(b"some bytes")
    digest = hashlib.sha256(b"some bytes").hexdigest()
    await api.upload_blob(data, digest, 10)
    blob = tmp_path / "coordinator" / "blobs" / digest[:2] / digest
    blob.write_bytes(b"rotten byte")  # the store's copy went bad
    with pytest.raises(ApiError) as error:
        await api.download_blob(digest, tmp_path / "out.bin")
    assert error.value.code == "digest_mismatch"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out.bin")]
    await alice.close()
