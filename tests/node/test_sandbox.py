"""The job sandbox (`gpuswarm.node.sandbox`): real bubblewrap runs for what owner code can and cannot reach, unit
tests for the GPU device mapping and the cgroup v2 decision on fake inputs, and the operator's `sandbox-check`."""

from __future__ import annotations

import importlib.machinery
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from gpuswarm.node import sandbox
from gpuswarm.node.sandbox import Cgroup, Limits, SandboxError

REPO = Path(__file__).resolve().parents[2]
needs_bwrap = pytest.mark.skipif(sandbox.unavailable_reason() is not None,
                                 reason=f"no working sandbox here: {sandbox.unavailable_reason()}")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop and RLIMIT_NPROC per sandbox uid need root")
PRELUDE = "from gpuswarm.node.sandbox import enter_from_environment\nenter_from_environment()\n"


def _workdir(tmp_path: Path, uid: int | None) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    if uid is not None:
        os.chown(work, uid, uid)
    return work


def run_inside(tmp_path: Path, code: str, *, limits: Limits = Limits(), readonly: dict | None = None,
               hide: list[Path] | None = None, env: dict | None = None, timeout: float = 20,
               parent_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `code` as the sandboxed process (after `enter`), as the sandbox uid when root."""
    uid = sandbox.sandbox_uid()
    work = tmp_path / "work" if (tmp_path / "work").exists() else _workdir(tmp_path, uid)
    argv = [sys.executable, "-I", "-B", "-c", PRELUDE + textwrap.dedent(code)]
    cmd = sandbox.command(argv, workdir=work, readonly=readonly or {}, hide=hide or [], gpus=[], limits=limits,
                          uid=uid, env=env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env=os.environ | (parent_env or {}))


def last_json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------- real bwrap

@needs_bwrap
def test_python_runs_inside_with_only_the_given_environment(tmp_path):
    done = run_inside(tmp_path, """
        import getpass, json, os, sys
        print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "uid": os.getuid(),
                          "caps": open("/proc/self/status").read(), "user": getpass.getuser()}))
    """, env={"GPUSWARM_JOB": "job-1"}, parent_env={"GPUSWARM_TEST_SECRET": "hunter2"})
    out = last_json(done)
    assert "GPUSWARM_TEST_SECRET" not in out["env"] and "hunter2" not in json.dumps(out["env"])
    assert out["env"]["GPUSWARM_JOB"] == "job-1"
    assert out["env"]["CUDA_VISIBLE_DEVICES"] == ""  # no GPU: none, even where the machine has some
    assert out["env"]["HOME"] == out["cwd"] == "/job/work"
    assert out["user"] == "job"  # the sandbox uid has no passwd entry; torch.compile's cache dir asks for a name
    assert sandbox.SANDBOX_ENV not in out["env"]  # enter_from_environment took it
    assert "CapEff:\t0000000000000000" in out["caps"]
    if os.geteuid() == 0:
        assert out["uid"] == sandbox.sandbox_uid()


@needs_bwrap
def test_code_planted_in_the_workdir_never_runs_before_enter(tmp_path):
    """An earlier run of the owner's code could leave a gpuswarm/ package in /job/work: `python -m` (not -I) must
    still import the installed one, or the planted code would run as root inside the sandbox."""
    work = _workdir(tmp_path, sandbox.sandbox_uid())
    (work / "gpuswarm").mkdir()
    (work / "gpuswarm" / "__init__.py").write_text("import os\nprint('PLANTED', os.getuid())\nraise SystemExit(0)\n")
    cmd = sandbox.command([sys.executable, "-m", "gpuswarm.node.sandboxcheck", "--probe", "capabilities",
                           "--target", "{}"], workdir=work, readonly={}, hide=[], gpus=[], limits=Limits(),
                          uid=sandbox.sandbox_uid(), env={"PYTHONSAFEPATH": "", "PYTHONNOUSERSITE": ""})
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    assert "PLANTED" not in done.stdout
    assert last_json(done)["contained"]


@needs_bwrap
def test_network_is_loopback_only_and_host_listener_unreachable(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        done = run_inside(tmp_path, f"""
            import json, socket
            s = socket.socket()
            s.settimeout(3)
            try:
                s.connect(("127.0.0.1", {port}))
                result = "connected"
            except OSError as e:
                result = type(e).__name__
            print(json.dumps({{"ifaces": [n for _, n in socket.if_nameindex()], "connect": result}}))
        """)
        listener.settimeout(0.1)
        with pytest.raises(TimeoutError):
            listener.accept()
    out = last_json(done)
    assert out["ifaces"] == ["lo"]
    assert out["connect"] == "ConnectionRefusedError"


@needs_bwrap
def test_hidden_state_is_invisible_even_under_a_bound_directory(tmp_path):
    # tmp_path stands for a system directory that happens to hold the node's state: bound at its own path.
    state = tmp_path / "state"
    (state / "jobs" / "other").mkdir(parents=True)
    key = state / "identity.key"
    key.write_text("SECRET KEY")
    loose = tmp_path / "loose.key"  # a hidden file, not a directory
    loose.write_text("SECRET FILE")
    for path in (tmp_path, state, state / "jobs"):
        path.chmod(0o755)
    key.chmod(0o644)  # readable by anyone: only the hiding keeps it out
    loose.chmod(0o644)
    (tmp_path / "visible.txt").write_text("fine")
    (tmp_path / "visible.txt").chmod(0o644)
    code = state / "cache" / "code-1"  # the job's code, fetched into the (hidden) cache, shown at /job/code
    code.mkdir(parents=True)
    (code / "train.py").write_text("print('owner code')")
    for path in (state / "cache", code):
        path.chmod(0o755)
    (code / "train.py").chmod(0o644)
    done = run_inside(tmp_path, f"""
        import json, os
        def read(p):
            try:
                return open(p).read()
            except OSError as e:
                return type(e).__name__
        print(json.dumps({{"key": read({str(key)!r}), "loose": read({str(loose)!r}), "code": read("/job/code/train.py"),
                          "state": os.listdir({str(state)!r}), "visible": read({str(tmp_path / "visible.txt")!r})}}))
    """, readonly={tmp_path: str(tmp_path), code: "/job/code"}, hide=[state, loose])
    out = last_json(done)
    assert out["code"] == "print('owner code')"
    assert out["visible"] == "fine"  # the bind works...
    assert out["key"] == "FileNotFoundError" and out["state"] == []  # ...and the state under it is covered
    assert out["loose"] == "PermissionError"  # /dev/null bound over it, on a nodev mount


@needs_bwrap
def test_system_is_read_only_and_workdir_writable_as_the_sandbox_uid(tmp_path):
    done = run_inside(tmp_path, """
        import json, os
        result = {}
        for path in ("/usr/gpuswarm-probe", "/etc/gpuswarm-probe", "/gpuswarm-probe", "/job/work/out.txt",
                     "/tmp/x", "/dev/shm/x"):
            try:
                open(path, "w").write("x")
                result[path] = "ok"
            except OSError as e:
                result[path] = type(e).__name__
        for path in ("/", "/job"):  # the sandbox's own root: passable, not listable
            try:
                result["list " + path] = os.listdir(path)
            except OSError as e:
                result["list " + path] = type(e).__name__
        print(json.dumps(result))
    """)
    out = last_json(done)
    assert out["/usr/gpuswarm-probe"] != "ok" and out["/etc/gpuswarm-probe"] != "ok"
    assert out["/gpuswarm-probe"] != "ok"
    assert out["/job/work/out.txt"] == out["/tmp/x"] == out["/dev/shm/x"] == "ok"
    if os.geteuid() == 0:
        assert out["list /"] == out["list /job"] == "PermissionError"
    assert not Path("/usr/gpuswarm-probe").exists()
    written = tmp_path / "work" / "out.txt"
    assert written.read_text() == "x"
    if os.geteuid() == 0:
        assert written.stat().st_uid == sandbox.sandbox_uid()


@needs_bwrap
@needs_root
def test_rlimit_nproc_stops_a_fork_loop(tmp_path):
    done = run_inside(tmp_path, """
        import errno, json, os
        r, w = os.pipe()
        children, error = [], None
        while len(children) < 2000:
            try:
                pid = os.fork()
            except OSError as e:
                error = errno.errorcode[e.errno]
                break
            if pid == 0:
                os.close(w)
                os.read(r, 1)
                os._exit(0)
            children.append(pid)
        os.close(w)
        for pid in children:
            os.waitpid(pid, 0)
        print(json.dumps({"children": len(children), "error": error}))
    """, limits=Limits(processes=16))
    out = last_json(done)
    assert out["error"] == "EAGAIN" and out["children"] < 16


@needs_bwrap
def test_rlimit_data_gives_memory_error(tmp_path):
    done = run_inside(tmp_path, """
        import json
        held = []
        try:
            while len(held) < 256:  # 4 GiB of address space, never touched
                held.append(bytearray(16 * 2**20))
            result = "not stopped"
        except MemoryError:
            result = "MemoryError"
        print(json.dumps({"result": result, "mib": len(held) * 16}))
    """, limits=Limits(memory_bytes=256 * 2**20))
    out = last_json(done)
    assert out["result"] == "MemoryError" and out["mib"] <= 256


@needs_bwrap
@needs_root
def test_sandbox_dies_with_its_parent(tmp_path):
    """The worker that started the sandbox is killed: every sandboxed process goes with it."""
    uid = sandbox.SANDBOX_UID_BASE + 4_000_000 + os.getpid() % 100_000  # no other process has it
    work = _workdir(tmp_path, uid)
    inner = PRELUDE + "import time\nprint('ready', flush=True)\ntime.sleep(120)\n"
    cmd = sandbox.command([sys.executable, "-I", "-B", "-c", inner], workdir=work, readonly={}, hide=[], gpus=[],
                          limits=Limits(), uid=uid, env={})
    parent_code = ("import subprocess, sys, time\n"
                   f"subprocess.Popen({cmd!r})\n"
                   "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"

        def sandboxed() -> list[psutil.Process]:
            return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]

        assert sandboxed()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while sandboxed() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sandboxed()
    finally:
        parent.kill()
        parent.wait()


@needs_bwrap
def test_cgroup_wrapper_runs_the_sandbox_after_joining_the_group(tmp_path):
    """On a real v2 host the shell writes its pid into cgroup.procs; here a plain file stands in for it."""
    group = tmp_path / "group with space"
    group.mkdir()
    work = _workdir(tmp_path, sandbox.sandbox_uid())
    cmd = sandbox.command([sys.executable, "-I", "-B", "-c", PRELUDE + "print('inside')"], workdir=work,
                          readonly={}, hide=[], gpus=[], limits=Limits(), uid=sandbox.sandbox_uid(), env={},
                          cgroup=Cgroup(group, Limits()))
    assert cmd[:2] == ["/bin/sh", "-c"] and cmd[4] == sandbox.bwrap_path()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "inside"
    assert (group / "cgroup.procs").read_text().strip().isdigit()


@needs_bwrap
def test_sandbox_check_contains_every_probe():
    done = subprocess.run([sys.executable, "-m", "gpuswarm.cli", "node", "sandbox-check", "--json"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    report = json.loads(done.stdout)
    assert report["available"] and report["probes"]
    assert [p["probe"] for p in report["probes"] if not p["ok"]] == [], report
    assert report["contained"] and done.returncode == 0


# ---------------------------------------------------------------------------------------------------- the command

def test_unavailable_reason_names_the_fix(tmp_path, monkeypatch):
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n")
    broken.chmod(0o755)
    try:
        sandbox.unavailable_reason.cache_clear()
        monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
        assert "apt-get install bubblewrap" in sandbox.unavailable_reason()
        sandbox.unavailable_reason.cache_clear()
        monkeypatch.setattr(sandbox, "bwrap_path", lambda: str(broken))
        assert sandbox.unavailable_reason() == ("bwrap cannot create namespaces here: bwrap: Creating new namespace "
                                                "failed: Operation not permitted")
    finally:
        sandbox.unavailable_reason.cache_clear()


def test_command_binds_packages_not_the_checkout(tmp_path):
    if sandbox.bwrap_path() is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    work = tmp_path / "work"
    work.mkdir()
    cmd = sandbox.command(["true"], workdir=work, readonly={}, hide=[], gpus=[], limits=Limits(), uid=None, env={})
    binds = {cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--ro-bind"}
    for package in ("node", "sdk", "proto", "gpuswarm"):
        assert str(REPO / package) in binds
    assert str(REPO) not in binds and str(REPO / "var") not in binds
    assert sys.prefix in binds or any(sys.prefix.startswith(b + "/") for b in binds)
    for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                 "--new-session", "--clearenv"):
        assert flag in cmd
    assert "--unshare-user" not in cmd
    assert cmd[cmd.index("--") + 1:] == ["true"]


def test_python_dirs_skip_the_working_directory_and_what_holds_state(tmp_path, monkeypatch):
    holder = tmp_path / "checkout"
    (holder / "var").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [*sys.path, "", str(holder), os.getcwd()])
    dirs = sandbox.python_dirs(exclude=[holder / "var"])
    assert str(holder) not in dirs and os.getcwd() not in dirs and "" not in dirs


@pytest.mark.parametrize("installed", [True, False])
def test_python_dirs_bind_a_pip_target_install_whole_but_not_a_checkout(tmp_path, monkeypatch, installed):
    """gpuswarm installed with `pip install --target DIR` (DIR on PYTHONPATH, its dependencies beside it) needs all of
    DIR inside; a source checkout that holds the package is bound as its package directory alone."""
    root = tmp_path / "site"
    (root / "gpuswarm").mkdir(parents=True)
    (root / "cryptography").mkdir()
    if installed:
        (root / "gpuswarm-0.1.0.dist-info").mkdir()
    found = importlib.machinery.ModuleSpec("gpuswarm", None, is_package=True)
    found.submodule_search_locations = [str(root / "gpuswarm")]
    monkeypatch.setattr(sandbox.importlib.util, "find_spec", lambda name: found if name == "gpuswarm" else None)
    monkeypatch.setattr(sys, "path", [str(root), *sys.path])
    dirs = sandbox.python_dirs()
    assert (str(root) in dirs) is installed
    assert str(root / "gpuswarm") in dirs


def test_the_sandbox_gets_only_the_bound_absolute_entries_of_the_nodes_pythonpath(tmp_path, monkeypatch):
    bound, unbound = tmp_path / "site", tmp_path / "work"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(bound), "", "relative/dir", str(unbound), "/job/work"]))
    assert sandbox.python_path([str(bound)]) == {"PYTHONPATH": str(bound)}
    monkeypatch.setenv("PYTHONPATH", "relative")
    assert sandbox.python_path([str(bound)]) == {}


# ---------------------------------------------------------------------------------------------------- GPUs

SMI = """0, GPU-11111111-aaaa-bbbb-cccc-000000000000, 00000000:17:00.0
1, GPU-22222222-aaaa-bbbb-cccc-000000000000, 00000000:65:00.0
2, GPU-33333333-aaaa-bbbb-cccc-000000000000, 00000000:CA:00.0
"""
PROC = {
    "0000:17:00.0": "Model: \t\t NVIDIA H100\nIRQ:   \t\t 35\nDevice Minor: \t 0\nBus Location: \t 0000:17:00.0\n",
    "0000:65:00.0": "Model: \t\t NVIDIA H100\nDevice Minor: \t 3\nBus Location: \t 0000:65:00.0\n",
    "0000:ca:00.0": "Model: \t\t NVIDIA H100\nDevice Minor: \t 1\nBus Location: \t 0000:ca:00.0\n",
}


def test_gpu_indices_map_to_their_device_minor_and_uuid():
    devices, visible = sandbox.nvidia_devices(["1", "2"], SMI, PROC)
    assert devices == ["/dev/nvidia3", "/dev/nvidia1"]  # by bus id, not by index
    assert visible == ["GPU-22222222-aaaa-bbbb-cccc-000000000000", "GPU-33333333-aaaa-bbbb-cccc-000000000000"]


def test_gpu_uuids_map_too():
    devices, visible = sandbox.nvidia_devices(["GPU-11111111-aaaa-bbbb-cccc-000000000000"], SMI, PROC)
    assert devices == ["/dev/nvidia0"] and visible == ["GPU-11111111-aaaa-bbbb-cccc-000000000000"]


def test_unknown_gpu_or_missing_minor_is_a_clear_error():
    with pytest.raises(SandboxError, match="not one nvidia-smi lists"):
        sandbox.nvidia_devices(["7"], SMI, PROC)
    with pytest.raises(SandboxError, match="Device Minor"):
        sandbox.nvidia_devices(["0"], SMI, {})


# ---------------------------------------------------------------------------------------------------- cgroup v2

def fake_tree(root: Path, mount: str = "sys/fs/cgroup", own: str = "daemon.service",
              subtree: dict[str, str] | None = None) -> Path:
    base = root / mount
    base.mkdir(parents=True)
    (base / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for rel, enabled in (subtree or {}).items():
        d = base / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.subtree_control").write_text(enabled)
    (base / own).mkdir(parents=True, exist_ok=True)
    return base


def test_cgroup_v2_own_group_with_controllers(tmp_path):
    base = fake_tree(tmp_path, subtree={"daemon.service": "cpu memory pids\n"})
    assert sandbox.cgroup_parent("0::/daemon.service\n", tmp_path) == (base / "daemon.service",
                                                                        {"cpu", "memory", "pids"})


def test_cgroup_v2_delegated_parent_and_hybrid_mount(tmp_path):
    # The daemon sits in a leaf of its delegated group (no internal processes in v2): sandboxes become siblings.
    base = fake_tree(tmp_path, mount="sys/fs/cgroup/unified", own="gpuswarm.service/daemon",
                     subtree={"gpuswarm.service": "memory pids\n", "gpuswarm.service/daemon": ""})
    cgroup_text = "4:memory:/x\n1:name=systemd:/gpuswarm.service\n0::/gpuswarm.service/daemon\n"
    assert sandbox.cgroup_parent(cgroup_text, tmp_path) == (base / "gpuswarm.service", {"memory", "pids"})


def test_no_cgroup_v2_here_means_rlimits_only(tmp_path):
    # This machine's shape: cgroup v1 controllers, a v2 hierarchy with none enabled.
    fake_tree(tmp_path, mount="sys/fs/cgroup/unified", own="", subtree={"": ""})
    assert sandbox.cgroup_parent("4:memory:/x\n0::/\n", tmp_path) is None
    assert sandbox.cgroup_parent("4:memory:/x\n", tmp_path) is None  # no v2 line at all
    assert sandbox.cgroup_parent("0::/\n", tmp_path / "nothing") is None  # no cgroup2 mount
    fake_tree(tmp_path / "b", subtree={"daemon.service": "memory\n"})  # pids missing
    assert sandbox.cgroup_parent("0::/daemon.service\n", tmp_path / "b") is None


def test_create_cgroup_writes_limits_and_reads_why_it_stopped(tmp_path):
    parent = tmp_path / "daemon.service"
    parent.mkdir()
    limits = Limits(memory_bytes=2 * 2**30, processes=99, cpus=1.5)
    group = sandbox.create_cgroup(limits, (parent, {"memory", "pids", "cpu"}), name="gpuswarm-sandbox-1")
    assert group.path == parent / "gpuswarm-sandbox-1"
    assert (group.path / "memory.max").read_text() == str(2 * 2**30)
    assert (group.path / "pids.max").read_text() == "99"
    assert (group.path / "cpu.max").read_text() == "150000 100000"
    assert group.limit_reason() is None
    (group.path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert group.oom_kills() == 1
    assert "memory limit (2048 MiB)" in group.limit_reason()
    without_cpu = sandbox.create_cgroup(Limits(cpus=2), (parent, {"memory", "pids"}), name="g2")
    assert not (without_cpu.path / "cpu.max").exists()  # not enabled there: warned, not written


def test_cgroup_remove_rmdirs_the_group(tmp_path):
    group = Cgroup(tmp_path / "g", Limits())
    group.path.mkdir()
    assert group.remove() and not group.path.exists()
    assert group.remove()  # already gone


def test_limits_travel_as_json_and_reject_nonsense():
    limits = Limits(memory_bytes=None, processes=10, cpu_seconds=5, cpus=0.5)
    assert Limits.from_json(limits.to_json()) == limits
    with pytest.raises(ValueError, match="processes"):
        Limits(processes=0)


def test_sandbox_check_without_a_sandbox_fails_with_the_reason(monkeypatch):
    from gpuswarm.node import sandboxcheck

    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: "bubblewrap (bwrap) is not installed: apt-get ...")
    output, code = sandboxcheck.report(as_json=True)
    assert code == 1 and json.loads(output) == {"available": False, "contained": False, "probes": [],
                                                "reason": "bubblewrap (bwrap) is not installed: apt-get ..."}
    output, code = sandboxcheck.report(as_json=False)
    assert code == 1 and "cannot sandbox" in output and "apt-get" in output
