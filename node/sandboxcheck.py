"""The operator's sandbox check (`gpuswarm node sandbox-check`): hostile probes run inside this node's own job
sandbox, each reported as contained or not.

Owns the probes (run inside, as `python -m gpuswarm.node.sandboxcheck --probe NAME --target JSON`, printing one
JSON line) and the host side that stages them: a throwaway state directory with a fake identity.key, a fake other
job's workdir and this job's workdir, TCP listeners standing in for the metrics port and the coordinator (one on
127.0.0.1, one on this machine's own non-loopback address), then one sandbox per probe, built by
`gpuswarm.node.sandbox.command` and entered with `enter` exactly as a job's is. The throwaway root is bound
read-only at its own path, as a system directory that happened to hold the node's state would be, and its state
directory is hidden, so the probes test the hiding as well. The fake files are world-readable: only the sandbox
keeps them out of reach. It never touches the node's real state.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from gpuswarm.node import sandbox

# Small limits, so that the fork bomb and the allocation stop quickly.
CHECK_LIMITS = sandbox.Limits(memory_bytes=512 * 2**20, processes=64, cpu_seconds=60, file_bytes=64 * 2**20,
                              open_files=256)
CANARY_ENV = "GPUSWARM_SANDBOX_CHECK_SECRET"
PROBE_TIMEOUT = 30.0
FORK_CAP = 5000  # a fork loop still going after this many was not stopped
ALLOC_CHUNK = 16 * 2**20
ALLOC_CAP = 8 * 2**30  # address space only: the chunks are never touched


@dataclass
class ProbeResult:
    probe: str
    expected: str
    result: str
    ok: bool


# ---------------------------------------------------------------------------------------------------- inside

def _try(action: Callable[[], object]) -> str | None:
    """None when `action` succeeded, else the error's short name."""
    try:
        action()
        return None
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, type(e).__name__)


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write_file(path: str, data: bytes = b"probe") -> None:
    with open(path, "wb") as f:
        f.write(data)


def probe_identity_key(target: dict) -> dict:
    key, state = target["identity_key"], target["state_dir"]
    read = _try(lambda: _read_file(key))
    listing = _listing(state)
    return {"contained": read is not None and not listing,
            "result": f"read: {read or 'SUCCEEDED'}; state dir shows {listing or 'nothing'}"}


def _listing(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def probe_other_job(target: dict) -> dict:
    other = target["other_workdir"]
    read = _try(lambda: _read_file(os.path.join(other, "model.pt")))
    listing = _listing(other) + _listing(target["jobs_dir"])
    return {"contained": read is not None and not listing,
            "result": f"read: {read or 'SUCCEEDED'}; listing shows {listing or 'nothing'}"}


def probe_write_outside(target: dict) -> dict:
    name = f"gpuswarm-probe-{uuid.uuid4().hex[:8]}"
    places = ["/usr", "/etc", "/", "/job", target["state_dir"], os.path.dirname(sys.executable)]
    outcome = {place: _try(lambda p=place: _write_file(os.path.join(p, name))) for place in places}
    written = [place for place, error in outcome.items() if error is None]
    return {"contained": not written,
            "result": "; ".join(f"{place}: {error or 'WRITTEN'}" for place, error in outcome.items())}


def probe_write_tmp(target: dict) -> dict:
    name = f"gpuswarm-probe-{uuid.uuid4().hex[:8]}"
    error = _try(lambda: _write_file(f"/tmp/{name}"))
    return {"contained": True, "result": f"/tmp/{name}: {error or 'written inside'}", "tmp_name": name,
            "written": error is None}


def probe_write_workdir(target: dict) -> dict:
    error = _try(lambda: _write_file(f"{sandbox.WORKDIR}/probe.txt"))
    return {"contained": error is None, "result": f"{sandbox.WORKDIR}/probe.txt: {error or 'written'}"}


def _connect(host: str, port: int) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        return _try(lambda: s.connect((host, port)))


def probe_host_loopback(target: dict) -> dict:
    port = target["loopback_port"]
    error = _connect("127.0.0.1", port)
    return {"contained": error is not None, "result": f"127.0.0.1:{port}: {error or 'CONNECTED'}"}


def probe_outside(target: dict) -> dict:
    addresses = [("1.1.1.1", 443)] + ([(target["own_ip"], target["own_port"])] if target.get("own_ip") else [])
    outcome = {f"{host}:{port}": _connect(host, port) for host, port in addresses}
    interfaces = sorted(name for _, name in socket.if_nameindex())
    return {"contained": all(outcome.values()) and interfaces == ["lo"],
            "result": "; ".join(f"{a}: {e or 'CONNECTED'}" for a, e in outcome.items())
            + f"; interfaces: {','.join(interfaces)}"}


def probe_fork_bomb(target: dict) -> dict:
    read_end, write_end = os.pipe()
    children, stopped_by = [], None
    while len(children) < FORK_CAP:
        try:
            pid = os.fork()
        except OSError as e:
            stopped_by = errno.errorcode.get(e.errno or 0, str(e))
            break
        if pid == 0:  # the child waits until the parent closes the pipe, then leaves without Python's cleanup
            os.close(write_end)
            os.read(read_end, 1)
            os._exit(0)
        children.append(pid)
    os.close(write_end)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    limit = target["processes"]
    return {"contained": stopped_by is not None and len(children) < limit,
            "result": f"{len(children)} processes started, then {stopped_by or 'NOT STOPPED'} (limit {limit})"}


def probe_memory(target: dict) -> dict:
    held, error = [], None
    try:
        while len(held) * ALLOC_CHUNK < ALLOC_CAP:
            held.append(bytearray(ALLOC_CHUNK))
    except MemoryError:
        error = "MemoryError"
    got = len(held) * ALLOC_CHUNK // 2**20
    held.clear()
    return {"contained": error is not None,
            "result": f"{error or 'NOT STOPPED'} after {got} MiB (limit {target['memory_bytes'] // 2**20} MiB)"}


def probe_capabilities(target: dict) -> dict:
    caps = sandbox.capabilities()
    status = Path("/proc/self/status").read_text()
    no_new_privs = next((line.split()[1] for line in status.splitlines() if line.startswith("NoNewPrivs")), "?")
    regain = _try(lambda: os.setuid(0))
    ok = (caps.get("CapEff") == 0 and caps.get("CapPrm") == 0 and caps.get("CapAmb") == 0 and os.getuid() != 0
          and os.geteuid() != 0 and regain is not None and no_new_privs == "1")
    return {"contained": ok,
            "result": f"uid {os.getuid()} gid {os.getgid()}; CapEff {caps.get('CapEff', 0):x} CapBnd "
                      f"{caps.get('CapBnd', 0):x}; NoNewPrivs {no_new_privs}; setuid(0): {regain or 'SUCCEEDED'}"}


def probe_host_processes(target: dict) -> dict:
    own = Path("/proc/self/comm").read_text().strip()
    seen = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                seen[int(entry)] = Path(f"/proc/{entry}/comm").read_text().strip()
    strangers = {pid: comm for pid, comm in seen.items() if comm not in ("bwrap", own)}
    host_pid_visible = _try(lambda: os.kill(target["host_pid"], 0)) is None and target["host_pid"] in seen
    return {"contained": not strangers and not host_pid_visible,
            "result": f"sees {len(seen)}: " + ", ".join(f"{pid} {comm}" for pid, comm in sorted(seen.items()))}


def probe_environment(target: dict) -> dict:
    names = sorted(os.environ)
    return {"contained": CANARY_ENV not in os.environ,
            "result": f"{CANARY_ENV}: {'VISIBLE' if CANARY_ENV in os.environ else 'absent'}; "
                      f"variables: {','.join(names)}"}


def probe_devices(target: dict) -> dict:
    entries = sorted(os.listdir("/dev"))
    allowed = {"console", "core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm", "stderr",
               "stdin", "stdout", "tty", "urandom", "zero"}
    extra = [e for e in entries if e not in allowed]
    return {"contained": not extra, "result": f"/dev: {','.join(entries)}"}


# (name, what a contained sandbox shows, the probe)
PROBES: list[tuple[str, str, Callable[[dict], dict]]] = [
    ("identity-key", "node identity.key unreadable, state dir empty", probe_identity_key),
    ("other-job", "another job's workdir invisible", probe_other_job),
    ("write-outside", "no write to /usr, /etc, /, /job, state, interpreter", probe_write_outside),
    ("write-tmp", "/tmp private: nothing appears on the host", probe_write_tmp),
    ("write-workdir", "/job/work writable, owned by the sandbox uid", probe_write_workdir),
    ("host-loopback", "no connection to the host's 127.0.0.1 listener", probe_host_loopback),
    ("outside", "no connection out; only interface lo", probe_outside),
    ("capabilities", "no capabilities, uid not 0, NoNewPrivs", probe_capabilities),
    ("host-processes", "only the sandbox's own processes", probe_host_processes),
    ("environment", "the parent's environment is not inherited", probe_environment),
    ("devices", "minimal /dev, no GPU on a CPU-only job", probe_devices),
    ("memory", "allocation stops at the memory limit", probe_memory),
    ("fork-bomb", "process creation stops at the limit", probe_fork_bomb),
]


def run_probe(name: str, target: dict) -> dict:
    probes = {probe_name: probe for probe_name, _, probe in PROBES}
    if name not in probes:
        raise SystemExit(f"no probe named {name!r}; known: {', '.join(probes)}")
    return probes[name](target)


# ---------------------------------------------------------------------------------------------------- host side

class _Listener:
    """A TCP listener in the host's namespaces that records whether anything reached it."""

    def __init__(self, host: str):
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"sandbox-check-listener-{host}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def own_address() -> str | None:
    """This machine's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("1.1.1.1", 53))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _stage(root: Path, uid: int | None) -> dict:
    """The throwaway state dir: a fake identity key, another job's workdir, this job's workdir (owned by `uid`)."""
    state = root / "state"
    jobs = state / "jobs"
    other = jobs / "other-job-0"
    work = jobs / "this-job-0"
    for d in (state, jobs, other, work, state / "cache"):
        d.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    for d in (state, jobs, other, state / "cache"):
        d.chmod(0o755)
    (state / "identity.key").write_text("FAKE IDENTITY KEY (gpuswarm sandbox-check)\n")
    (other / "model.pt").write_text("another job's model\n")
    for f in (state / "identity.key", other / "model.pt"):
        f.chmod(0o644)  # readable by anyone: only the sandbox may keep it out of reach
    if uid is not None:
        os.chown(work, uid, uid)
    return {"state_dir": str(state), "jobs_dir": str(jobs), "identity_key": str(state / "identity.key"),
            "other_workdir": str(other), "workdir": str(work)}


def _parse(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                return json.loads(line)
    return None


def run_check(limits: sandbox.Limits = CHECK_LIMITS) -> list[ProbeResult]:
    """Run every probe in its own sandbox; raises SandboxError when this node cannot sandbox."""
    reason = sandbox.unavailable_reason()
    if reason is not None:
        raise sandbox.SandboxError(reason)
    uid = sandbox.sandbox_uid()
    results = []
    root = Path(tempfile.mkdtemp(prefix="gpuswarm-sandbox-check-"))
    loopback = _Listener("127.0.0.1")
    address = own_address()
    outside = _Listener(address) if address else None
    try:
        target = _stage(root, uid) | {
            "loopback_port": loopback.port, "own_ip": address, "own_port": outside.port if outside else None,
            "processes": limits.processes, "memory_bytes": limits.memory_bytes or 0, "host_pid": os.getpid()}
        workdir = Path(target["workdir"])
        for name, expected, _ in PROBES:
            argv = sandbox.python_argv("gpuswarm.node.sandboxcheck", "--probe", name, "--target", json.dumps(target))
            with sandbox.sandbox_cgroup(limits) as group:
                cmd = sandbox.command(argv, workdir=workdir, readonly={root: str(root)},
                                      hide=[Path(target["state_dir"])], gpus=[], limits=limits, uid=uid, env={},
                                      cgroup=group)
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                                          stdin=subprocess.DEVNULL, env=os.environ | {CANARY_ENV: "host secret"})
                    report, tail = _parse(done.stdout), (done.stderr.strip().splitlines() or [""])[-1]
                    limit_hit = group.limit_reason() if group is not None else None
                except subprocess.TimeoutExpired:
                    report, tail, limit_hit = None, f"timed out after {PROBE_TIMEOUT:.0f}s", None
            if report is None:
                # A probe the kernel ended at a cgroup limit (the OOM killer, pids.max) was contained too.
                results.append(ProbeResult(name, expected, limit_hit or f"probe failed: {tail}"[:300],
                                           limit_hit is not None))
                continue
            ok = bool(report.get("contained"))
            result = str(report.get("result", ""))
            if name == "write-tmp" and report.get("written"):
                leaked = Path("/tmp", report["tmp_name"])
                ok = not leaked.exists()
                result += "; on the host: " + ("PRESENT" if not ok else "absent")
                with contextlib.suppress(OSError):
                    leaked.unlink()
            elif name == "write-workdir" and ok:
                written = workdir / "probe.txt"
                owner = written.stat().st_uid if written.exists() else None
                ok = owner is not None and (uid is None or owner == uid)
                result += f"; on the host: owner uid {owner}"
            elif name == "host-loopback":
                ok = ok and loopback.connections == 0
                result += f"; host listener saw {loopback.connections} connection(s)"
            elif name == "outside" and outside is not None:
                ok = ok and outside.connections == 0
                result += f"; host listener saw {outside.connections} connection(s)"
            results.append(ProbeResult(name, expected, result, ok))
    finally:
        loopback.close()
        if outside is not None:
            outside.close()
        shutil.rmtree(root, ignore_errors=True)
    return results


def format_table(results: list[ProbeResult], width: int = 100) -> str:
    rows = [("probe", "expected", "result", "ok")]
    rows += [(r.probe, r.expected, r.result if len(r.result) <= width else r.result[:width - 3] + "...",
              "yes" if r.ok else "NO") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [" | ".join([row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]), row[3]])
             for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in [*widths, 3]))
    return "\n".join(lines)


def report(as_json: bool) -> tuple[str, int]:
    """The check's output and exit code: 0 when every probe was contained, 1 otherwise or without a sandbox."""
    started = time.monotonic()
    try:
        results = run_check()
    except sandbox.SandboxError as e:
        return (json.dumps({"available": False, "reason": str(e), "contained": False, "probes": []}) if as_json
                else f"this node cannot sandbox job code: {e}"), 1
    contained = all(r.ok for r in results)
    if as_json:
        return json.dumps({"available": True, "contained": contained, "probes": [asdict(r) for r in results],
                           "seconds": round(time.monotonic() - started, 1)}), 0 if contained else 1
    summary = ("every probe was contained" if contained
               else f"NOT CONTAINED: {', '.join(r.probe for r in results if not r.ok)}")
    return f"{format_table(results)}\n\n{summary} ({time.monotonic() - started:.1f}s)", 0 if contained else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One sandbox-check probe, run inside the sandbox.")
    parser.add_argument("--probe", required=True)
    parser.add_argument("--target", required=True, help="JSON: the paths and ports the probes aim at")
    args = parser.parse_args(argv)
    sandbox.enter_from_environment()
    print(json.dumps(run_probe(args.probe, json.loads(args.target))), flush=True)


if __name__ == "__main__":
    main()
