"""`gpuswarm job submit` with the owner's own code and data, against the real coordinator app over real HTTP: the
real command in a subprocess packs, checks the params, uploads only what the coordinator lacks for this owner, and
posts the job by the hashes; a quota refusal is shown plainly. Then `job artifacts`, `job download --checkpoint`
and `job logs` on a job a real (signed) node client uploaded to.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.client.api import CoordinatorClient
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, CoordinatorConfig
from gpuswarm.node.identity import Identity
from gpuswarm.proto.models import AssignmentFailure, Heartbeat, NodeRegistration, NodeState, Resources

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = '''
from pydantic import BaseModel


class Params(BaseModel):
    hidden: int = 8


def TinyLM(ctx):
    raise RuntimeError("not built here")


TinyLM.Params = Params
'''
JOB = '''
name = "tinylm"
budget = 1.0

[code]
path = "."
entrypoint = "tinylm.workload:TinyLM"
exclude = ["data/*", "*.toml"]

[dataset]
path = "data"

[params]
hidden = 16

[stop]
max_steps = 100

[requirements]
min_gpu_memory_gb = 4000  # no node here can take it: the job stays pending
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "tinylm").mkdir(parents=True)
    (root / "tinylm/__init__.py").write_text("")
    (root / "tinylm/workload.py").write_text(WORKLOAD)
    (root / "data").mkdir()
    (root / "data/a.bin").write_bytes(os.urandom(300_000))
    (root / "data/b.bin").write_bytes(os.urandom(1000))
    (root / "job.toml").write_text(JOB)
    return root


def gpuswarm_command() -> list[str]:
    script = Path(sys.executable).with_name("gpuswarm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpuswarm.cli"]


async def run(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*gpuswarm_command(), *args, cwd=ROOT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


async def coordinator_env(tmp_path: Path, server: TestServer, app, credits: float = 10.0) -> dict[str, str]:
    url = str(server.make_url("")).rstrip("/")
    owner = await CoordinatorClient(url, token=app[ADMIN_TOKEN]).create_owner("olivia", credits)
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    return env | {"GPUSWARM_COORDINATOR": url, "GPUSWARM_TOKEN": owner.token, "COLUMNS": "200",
                  "GPUSWARM_CACHE_DIR": str(tmp_path / "cache")}


async def test_submit_uploads_only_what_the_coordinator_lacks(tmp_path, project):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2))
    async with TestServer(app) as server:
        env = await coordinator_env(tmp_path, server, app)
        code, out, err = await run(env, "job", "submit", str(project / "job.toml"), "--json")
        assert code == 0, err
        job = json.loads(out)
        spec = job["spec"]
        assert spec["code"]["entrypoint"] == "tinylm.workload:TinyLM" and spec["dataset"]["name"] == "data"
        assert spec["hyperparameters"] == {"hidden": 16}
        code_sha, data_sha = spec["code"]["sha256"], spec["dataset"]["sha256"]
        assert "packed code 2 files" in err and f"sha256 {code_sha[:8]}…" in err
        assert f"packed dataset 2 files 301.0 KB sha256 {data_sha[:8]}…" in err
        assert err.count("uploaded in") == 2 and "already on the coordinator" not in err

        # Unchanged: nothing is packed again nor uploaded.
        code, out, err = await run(env, "job", "submit", str(project / "job.toml"), "--no-local-check")
        assert code == 0, err
        assert "submitted j-" in out and "(tinylm.workload:TinyLM, 1-1 nodes)" in out
        assert err.count("(unchanged since the last pack)") == 2 and err.count("(already on the coordinator)") == 2
        assert "uploaded in" not in err and "--no-local-check" in err

        # One byte of code changed: only the code goes up again.
        (project / "tinylm/workload.py").write_text(WORKLOAD + "\n# changed\n")
        code, out, err = await run(env, "job", "submit", str(project / "job.toml"), "--no-local-check")
        assert code == 0, err
        assert "dataset 2 files 301.0 KB" in err and err.count("(already on the coordinator)") == 1
        assert err.count("uploaded in") == 1 and "code 2 files" in err.split("uploaded in")[0].splitlines()[-1]

        code, out, err = await run(env, "job", "list")
        assert code == 0 and out.count("tinylm.workload:TinyLM") == 3, err


async def test_a_quota_refusal_is_shown_plainly(tmp_path, project):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2,
                                       owner_quota_bytes=100_000))
    async with TestServer(app) as server:
        env = await coordinator_env(tmp_path, server, app)
        code, out, err = await run(env, "job", "submit", str(project / "job.toml"), "--no-local-check")
    assert code == 1 and out == ""
    assert "error: upload of the dataset (" in err and "quota" in err, err
    assert "Traceback" not in err


async def test_a_bad_param_stops_submit_before_any_upload(tmp_path, project):
    (project / "job.toml").write_text(JOB.replace("hidden = 16", 'hidden = "big"'))
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2))
    async with TestServer(app) as server:
        env = await coordinator_env(tmp_path, server, app)
        code, out, err = await run(env, "job", "submit", str(project / "job.toml"))
        assert code == 1 and out == ""
        assert "error: tinylm.workload:TinyLM: invalid params: hidden: Input should be a valid integer" in \
            " ".join(err.split()), err
        assert "upload" not in err


async def test_artifacts_download_a_checkpoint_and_logs(tmp_path):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2))
    identity = Identity(Ed25519PrivateKey.generate())
    async with TestServer(app) as server:
        env = await coordinator_env(tmp_path, server, app)
        url = env["GPUSWARM_COORDINATOR"]
        owner = CoordinatorClient(url, token=env["GPUSWARM_TOKEN"])
        async with CoordinatorClient(url, identity) as node:
            await node.register(NodeRegistration(node_id=identity.node_id, software_version="test",
                                                 resources=Resources(cpu_cores=2, ram_gb=4)))
            job = await owner.submit_job({"workload": "digits-mlp", "stop": {"max_epochs": 1}})
            for _ in range(100):
                if await node.assignments():
                    break
                await asyncio.sleep(0.1)
            for step in (20, 40):
                checkpoint = tmp_path / f"checkpoint-{step:08d}.pt"
                checkpoint.write_bytes(b"state" * step)
                await node.upload(job.id, checkpoint, final=False)
            reason = "Traceback (most recent call last):\n" + "x" * 500 + "\nModuleNotFoundError: " \
                "cannot import 'tinylm'"
            await node.heartbeat(Heartbeat(node_id=identity.node_id, state=NodeState.IDLE,
                                           failures=[AssignmentFailure(job_id=job.id, reason=reason)]))

        code, out, err = await run(env, "job", "artifacts", job.id)
        assert code == 0, err
        lines = [line.split() for line in out.splitlines() if "checkpoint-" in line]
        assert [line[1:3] for line in lines] == [["checkpoint", "20"], ["checkpoint", "40"]], out
        code, out, err = await run(env, "job", "artifacts", job.id, "--json")
        assert [(a["kind"], a["step"]) for a in json.loads(out)] == [("checkpoint", 20), ("checkpoint", 40)]

        dest = tmp_path / "latest.pt"
        code, out, err = await run(env, "job", "download", job.id, "--checkpoint", "latest", "-o", str(dest))
        assert code == 0, err
        assert dest.read_bytes() == b"state" * 40 and "checkpoint of step 40" in out
        code, out, err = await run(env, "job", "download", job.id, "--checkpoint", "30")
        assert code == 1 and "--checkpoint takes latest or a step of the job's checkpoints: 20, 40" in err
        code, out, err = await run(env, "job", "download", job.id, "--name", "checkpoint-00000020.pt",
                                   "-o", str(tmp_path / "first.pt"))
        assert code == 0 and (tmp_path / "first.pt").read_bytes() == b"state" * 20, err
        code, out, err = await run(env, "job", "download", job.id)
        assert code == 1 and "has no final model yet" in err

        code, out, err = await run(env, "job", "logs", job.id)
        assert code == 0, err
        assert out.splitlines()[0].split(" ", 2)[2].startswith("submitted")
        assert "x" * 500 + "\nModuleNotFoundError: cannot import 'tinylm'" in out  # the full reason, not its end
        code, out, err = await run(env, "job", "logs", job.id, "--json")
        records = json.loads(out)
        assert records == sorted(records, key=lambda r: r["at"])
        assert any(r["message"] == f"node {identity.node_id} failed: {reason}" for r in records)
