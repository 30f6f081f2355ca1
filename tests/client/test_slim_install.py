"""`pip install gpuswarm` without extras: the job owner's CLI works, and a command that needs an extra says which.

The real `gpuswarm` command runs in a subprocess whose interpreter cannot import the extras' packages (a meta-path
hook in a sitecustomize on PYTHONPATH refuses them, as if they were not installed), against the real coordinator
app over real HTTP, which runs in this test's process with everything installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer
from gpuswarm.client.api import SyncClient
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, CoordinatorConfig

ROOT = Path(__file__).resolve().parents[2]
# Every package the node and coordinator extras bring, by top-level import name.
EXTRAS_ONLY = ["torch", "hivemind", "numpy", "sklearn", "sqlalchemy", "alembic", "aiosqlite", "tensorboardX",
               "pyroute2", "prometheus_client"]
SITECUSTOMIZE = f'''
import sys

MISSING = {set(EXTRAS_ONLY)!r}


class NotInstalled:
    """Refuses the extras' packages, as an interpreter without them would."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
'''
JOB_FILE = """
name = "slim"
workload = "digits-mlp"
budget = 1.5

[stop]
max_epochs = 3

[requirements]
min_gpu_memory_gb = 4000  # no node here can take it: the job stays pending
allow_cpu = false
"""


@pytest.fixture
def slim_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a `gpuswarm` without extras."""
    hook = tmp_path / "slim"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    return env | {"PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [env.get("PYTHONPATH")])]),
                  "COLUMNS": "160"}


def gpuswarm_command() -> list[str]:
    """The installed console script (what `pip install gpuswarm` puts on PATH), or the module if there is none."""
    script = Path(sys.executable).with_name("gpuswarm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpuswarm.cli"]


async def slim(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*gpuswarm_command(), *args, cwd=ROOT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


async def test_the_hook_really_hides_the_extras(slim_env):
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import numpy", cwd=ROOT, env=slim_env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode != 0 and "No module named 'numpy'" in out.decode()


async def test_help_and_every_group_help_work_without_extras(slim_env):
    code, out, err = await slim(slim_env, "--help")
    assert code == 0, err
    for group in ("coordinator", "node", "job", "nodes", "mesh", "dht"):
        assert group in out
        code, out_group, err = await slim(slim_env, group, "--help")
        assert code == 0, (group, err)


async def test_job_validate_works_offline_without_extras(slim_env, tmp_path):
    job_file = tmp_path / "job.toml"
    job_file.write_text(JOB_FILE)
    code, out, err = await slim(slim_env, "job", "validate", str(job_file))
    assert code == 0, err
    spec = json.loads(out)
    assert spec["workload"] == "digits-mlp" and spec["budget"] == 1.5 and spec["stop"]["max_epochs"] == 3
    assert "hyperparameters" in spec and spec["max_nodes"] == 1  # defaults filled in

    job_file.write_text(JOB_FILE.replace('workload = "digits-mlp"', 'workload = "no-such-workload"'))
    code, out, err = await slim(slim_env, "job", "validate", str(job_file))
    assert code == 1 and out == "" and "no-such-workload" in err


async def test_job_submit_list_and_nodes_against_a_real_coordinator_without_extras(slim_env, tmp_path):
    job_file = tmp_path / "job.toml"
    job_file.write_text(JOB_FILE)
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2))
    async with TestServer(app) as server:
        url = str(server.make_url("")).rstrip("/")
        admin = SyncClient(url, token=app[ADMIN_TOKEN])
        owner = await asyncio.to_thread(admin.create_owner, "slim-owner", 10.0)
        env = slim_env | {"GPUSWARM_COORDINATOR": url, "GPUSWARM_TOKEN": owner.token}

        code, out, err = await slim(env, "job", "submit", str(job_file), "--json")
        assert code == 0, err
        submitted = json.loads(out)
        assert submitted["name"] == "slim" and submitted["state"] == "pending"

        code, out, err = await slim(env, "job", "list", "--json")
        assert code == 0, err
        assert [j["id"] for j in json.loads(out)] == [submitted["id"]]
        code, out, err = await slim(env, "job", "list")
        assert code == 0, err
        assert submitted["id"] in out and "1 job: 1 pending" in out

        code, out, err = await slim(env, "job", "status", submitted["id"])
        assert code == 0, err
        assert "state: pending" in out
        code, out, err = await slim(env, "nodes", "--json")
        assert code == 0 and json.loads(out) == [], err
        code, out, err = await slim(env, "coordinator", "credit", owner.id, "2.5", "--admin-token", app[ADMIN_TOKEN])
        assert code == 0, err
        assert f"{owner.id} balance: 12.500000" in out


@pytest.mark.parametrize(("command", "extra"), [(["node", "start", "--no-mesh", "--cpu"], "node"),
                                                (["node", "evaluate", "model.pt"], "node"),
                                                (["coordinator", "serve"], "coordinator"),
                                                (["coordinator", "migrate"], "coordinator")])
async def test_a_command_that_needs_an_extra_names_it(slim_env, tmp_path, command, extra):
    code, out, err = await slim(slim_env | {"GPUSWARM_COORDINATOR": "http://127.0.0.1:9"}, *command,
                                *(["--state-dir", str(tmp_path / "node")] if command[1] == "start" else []),
                                *(["--data-dir", str(tmp_path / "c")] if command[0] == "coordinator" else []))
    assert code != 0
    assert f"gpuswarm[{extra}]" in err, err
    assert "Traceback" not in err, err
