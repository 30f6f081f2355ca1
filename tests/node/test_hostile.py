"""Hostile owners' code against the real sandbox: each attack runs inside the job's bubblewrap sandbox, driven by
the trusted side exactly as a node drives it (`TrainerLink`, `SharedParams`), and must fail or be contained, with
a reason the job's owner can read. The node's side (this test process) carries on after every one.

The node's state is laid out as a daemon lays it out: an identity key and other jobs' workdirs in the state dir,
this job's workdir under it, so "hidden" is tested where it matters."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
from gpuswarm.node import sandbox
from gpuswarm.node.trainer_link import Inputs, Settings, TrainerFailed, TrainerLink
from gpuswarm.node.worker import SharedParams
from gpuswarm.proto.models import JobSpec

pytestmark = pytest.mark.skipif(sandbox.unavailable_reason() is not None,
                                reason=f"no sandbox here: {sandbox.unavailable_reason()}")

HOSTILE = Path(__file__).with_name("hostile_workload.py")


@pytest.fixture
def node(tmp_path):
    """A node's state dir with its secrets, an owner's code directory, and two listeners in the host network
    standing in for the coordinator and the node's metrics port."""
    state = tmp_path / "state"
    (state / "jobs" / "j-other").mkdir(parents=True)
    (state / "identity.key").write_bytes(b"SECRET-SIGNING-KEY")
    (state / "identity.key").chmod(0o600)
    (state / "jobs" / "j-other" / "secret.txt").write_text("another owner's data")
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(HOSTILE, code / "hostile_workload.py")
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    yield state, code, [s.getsockname()[1] for s in listeners]
    for s in listeners:
        s.close()


def run_attack(state: Path, code: Path, attack: str, target: str = "", when: str = "loss",
               timeout: float = 30.0, inner: bool = False) -> TrainerLink:
    """Start the hostile workload in the sandbox and take one step (`inner`: three inner steps, as in mode
    "diloco"); returns the link after a request that worked."""
    spec = JobSpec.model_validate({
        "code": {"sha256": "0" * 64, "size": 1, "format": "tar", "entrypoint": "hostile_workload:Hostile"},
        "hyperparameters": {"attack": attack, "target": target, "when": when}, "stop": {"max_steps": 5}})
    settings = Settings(sandboxed=True, limits=sandbox.Limits(memory_bytes=768 * 2**20, processes=64),
                        answer_timeout=timeout, hide=(state,))
    link = TrainerLink(state / "jobs" / "j-this", settings)
    try:
        link.start(spec.model_dump(mode="json"), Inputs(code=code), gpus=[], threads=1, nice=0)
        if inner:
            link.request("inner", "inner", "computing inner steps", version=0, steps=3, seconds=timeout, index=0,
                         count=1, step=0, resume=None)
        else:
            link.request("step", "step", "computing step 1", version=0, index=0, count=1, step=0, resume=None)
    except BaseException:
        link.close()
        raise
    return link


def failure(state: Path, code: Path, attack: str, target: str = "", **kw) -> str:
    with pytest.raises(TrainerFailed) as failed:
        link = run_attack(state, code, attack, target, **kw)
        link.close()
    return str(failed.value)


def test_owners_code_cannot_read_the_node_identity_key(node):
    state, code, _ = node
    assert "Blocked" in failure(state, code, "read", f"{state}/identity.key")
    assert "Blocked" in failure(state, code, "read", f"{state}/identity.key", when="build")


def test_owners_code_cannot_see_another_jobs_workdir(node):
    state, code, _ = node
    assert "Blocked" in failure(state, code, "read", f"{state}/jobs/j-other/secret.txt")
    assert "Blocked" in failure(state, code, "list", f"{state}/jobs,{state},/job/../")


def test_owners_code_cannot_write_outside_its_workdir(node):
    state, code, _ = node
    targets = ["/usr/owned", "/etc/owned", "/job/code/owned.py", f"{state}/owned", f"{code}/owned.py",
               str(Path(sandbox.__file__).with_name("owned.py"))]
    assert "Blocked" in failure(state, code, "write", ",".join(targets))
    assert not any(Path(t).exists() for t in targets[3:])


def test_owners_code_has_no_network(node):
    state, code, (coordinator, metrics) = node
    outside = ["1.1.1.1:443", "8.8.8.8:53"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # this host's own address on its network
        try:
            probe.connect(("8.8.8.8", 53))
            outside.append(f"{probe.getsockname()[0]}:{coordinator}")
        except OSError:
            pass
    reason = failure(state, code, "connect", ",".join([f"127.0.0.1:{coordinator}", f"127.0.0.1:{metrics}",
                                                       *outside]))
    assert "Blocked" in reason and "Escaped" not in reason, reason


def sandbox_processes(uid: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_fork_bomb_is_stopped_at_the_process_limit_and_cleaned_up(node):
    state, code, _ = node
    reason = failure(state, code, "fork_bomb")
    assert "Resource temporarily unavailable" in reason or "exited" in reason or "channel" in reason, reason
    uid = sandbox.sandbox_uid()
    if uid is not None:
        assert sandbox_processes(uid) == [], "the sandbox's processes outlived it"
    pid = os.fork()  # the host can still start processes
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_unbounded_memory_ends_in_the_memory_limit(node):
    state, code, _ = node
    reason = failure(state, code, "memory")
    assert "MemoryError" in reason or "out of memory" in reason, reason


def test_code_that_spins_forever_is_stopped_after_the_step_timeout(node):
    state, code, _ = node
    reason = failure(state, code, "spin", timeout=4.0)
    assert "did not answer within 4s while computing step 1" in reason, reason


def test_an_exit_in_the_middle_of_a_step_is_a_clear_failure(node):
    state, code, _ = node
    reason = failure(state, code, "exit")
    assert reason.startswith("the workload's process exited with code 7 while computing step 1"), reason


def test_nan_written_into_the_shared_gradient_buffer_is_refused(node):
    state, code, _ = node
    link = run_attack(state, code, "nan_gradients")
    try:
        shared = SharedParams(link)
        with pytest.raises(TrainerFailed, match="non-finite values"):
            shared.take_grads()
        assert all(p.grad is None for p in shared.params)  # nothing reached the optimizer
    finally:
        link.close()


def test_a_non_finite_loss_in_the_inner_steps_is_refused_with_its_reason(node):
    state, code, _ = node
    reason = failure(state, code, "nan_loss", inner=True)
    assert "the training loss was not finite in one of 3 inner steps" in reason, reason


@pytest.mark.parametrize("target", ["{state}/identity.key", "fifo"])
def test_files_the_workload_writes_are_never_followed_out_of_its_workdir(node, target):
    state, code, _ = node
    link = run_attack(state, code, "symlink", target.format(state=state))
    try:
        link.request("save_state", "saved", "saving", version=0, name="state.pt")
        with pytest.raises(TrainerFailed, match="cannot be opened|not a regular file"):
            link.take_file("state.pt", 2**20)
        link.request("save_model", "saved", "saving", version=0, name="model.pt", metrics={}, metadata={})
        with pytest.raises(TrainerFailed, match="cannot be opened|not a regular file"):
            link.take_file("model.pt", 2**20, dest=state / "jobs" / "model.pt")
        assert not (state / "jobs" / "model.pt").exists()
    finally:
        link.close()


def test_a_benign_step_trades_gradients_and_parameters_through_shared_memory(node):
    import torch

    state, code, _ = node
    link = run_attack(state, code, "none")
    try:
        shared = SharedParams(link)
        shared.bind_grads()  # mode "sync": hivemind reads the gradients from the shared copy
        shared.take_grads()
        assert shared.flat.grad is shared.grad_flat and torch.isfinite(shared.flat.grad).all()
        assert float(shared.grad_flat.abs().sum()) > 0
        with torch.no_grad():
            for p in shared.params:
                p.fill_(0.5)
        shared.publish()
        link.request("save_state", "saved", "saving", version=shared.version, name="state.pt")
        saved = torch.load(link.box / "state.pt", weights_only=True)
        assert all(torch.equal(t, torch.full_like(t, 0.5)) for t in saved.values())  # the trainer took them
    finally:
        link.close()
