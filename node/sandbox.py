"""The job sandbox: where a job owner's (untrusted) training code runs on a node.

Owns whether this node can sandbox (`unavailable_reason`), the uid a sandbox runs as (`sandbox_uid`), the limits
(`Limits`), the bubblewrap command line for one job's sandbox (`command`), the optional cgroup v2 group around it
(`sandbox_cgroup`), and the "enter" step the sandboxed process runs first (`enter`). It starts nothing itself: the
worker (`gpuswarm.node.worker`) runs the command, and the trainer calls `enter` before it imports owner code. It
never touches the node's state, the DHT or the coordinator.

What the sandbox is: bwrap with new pid, net (loopback only), ipc, uts and (when possible) cgroup namespaces, but NOT
a user namespace: as root, the uid drop in `enter` needs the initial user namespace (with a user namespace,
setgroups fails with EPERM). Inside, the system (/usr, /etc, /opt, ...) and the interpreter's own directories are
read-only at their host paths, the job's workdir is read-write at /job/work, /tmp and /dev/shm are private and
size-bounded tmpfs, /dev is minimal plus the job's own GPUs, the environment is only what the caller names, and
the node's state (`hide`) is covered with an empty tmpfs wherever a bind would reach it. The sandboxed process
starts as root with capabilities (bwrap needs them, and so does the uid drop), so nothing the owner's code could
have written may run before `enter`: see PYTHON_SAFETY.

GPUs: only the job's /dev/nvidiaN (found through nvidia-smi's PCI bus ids and /proc/driver/nvidia) plus the control
devices are bound, and CUDA_VISIBLE_DEVICES names them by UUID. The runner's indices are nvidia-smi's (PCI order);
run the daemon with CUDA_DEVICE_ORDER=PCI_BUS_ID where CUDA's order could differ. MIG (/dev/nvidia-caps) is not
handled.

Resource limits come in two layers. rlimits, set by `enter`, always: RLIMIT_DATA for memory (not RLIMIT_AS: CUDA
reserves huge address ranges), RLIMIT_NPROC for processes (the kernel counts it per uid, which is why each worker
process gets its own uid, and counts threads too), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE 0. A cgroup
v2 group (memory.max, pids.max, cpu.max) comes on top when the node has a delegated cgroup v2 with those
controllers; `Limits.cpus` has no rlimit equivalent and is enforced only there. The cgroup code is tested against a
fake directory tree only: it is untested on a real cgroup v2 host.

Not covered: no seccomp filter (the kernel's whole syscall surface is reachable), no disk quota on /job/work
(RLIMIT_FSIZE bounds single files only), and /proc shows host-wide facts (meminfo, cpuinfo) though not host
processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import json
import logging
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SANDBOX_UID_BASE = 200_000
WORKDIR = "/job/work"  # the job's read-write directory, inside
SANDBOX_ENV = "GPUSWARM_SANDBOX"  # set inside: {"limits": {...}, "uid": N}, read by `enter_from_environment`
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/opt")
PACKAGES = ("gpuswarm", "gpuswarm.node", "gpuswarm.sdk", "gpuswarm.proto")  # what the trainer imports
NAMESPACES = ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try")
NVIDIA_COMMON = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
# The sandboxed interpreter is root (with capabilities) until `enter` runs. Without these, `python -m ...` would put
# its working directory, /job/work, which an earlier run of the owner's code could write, first on sys.path (a
# planted gpuswarm/ package would run as root), and a user site under HOME=/job/work would run its .pth files.
PYTHON_SAFETY = {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
# The sandbox uid has no passwd entry: getpass.getuser() (torch.compile's and triton's cache directories call it)
# would raise "getpwuid(): uid not found". It reads these first. Seen on an H100 node: AdamW stepped inside failed so.
JOB_USER = {"USER": "job", "LOGNAME": "job"}
CGROUP_PREFIX = "gpuswarm-sandbox-"
CPU_PERIOD_US = 100_000

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
CAP_SETPCAP = 8


class SandboxError(RuntimeError):
    """The sandbox cannot be built or entered as asked; the message says why, for an operator."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int | None = 8 * 2**30  # cgroup memory.max, else RLIMIT_DATA; also the size of /tmp and /dev/shm
    processes: int = 256  # cgroup pids.max, else RLIMIT_NPROC (counts threads too; torch needs some)
    cpu_seconds: int | None = None  # RLIMIT_CPU: total CPU time; None = unlimited
    cpus: float | None = None  # cgroup cpu.max quota in cores; no rlimit equivalent, so ignored without a cgroup
    file_bytes: int = 64 * 2**30  # RLIMIT_FSIZE: the biggest file it may write
    open_files: int = 1024  # RLIMIT_NOFILE

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "processes", "cpu_seconds", "cpus", "file_bytes", "open_files"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"sandbox limit {name} must be positive, not {value!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Limits:
        return cls(**json.loads(text))


# ---------------------------------------------------------------------------------------------------- availability

def bwrap_path() -> str | None:
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)),
                                         None)


@functools.cache
def unavailable_reason() -> str | None:
    """None when bubblewrap is installed and actually works here, else a sentence for an operator. Tried once per
    process: bwrap with the sandbox's namespace flags and the features `command` uses (sized tmpfs with --perms,
    bubblewrap 0.7 or newer) runs /bin/true."""
    bwrap = bwrap_path()
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    args = [bwrap, *NAMESPACES, "--die-with-parent", "--new-session", *_system_args(), "--proc", "/proc",
            "--dev", "/dev", "--perms", "1777", "--size", str(2**20), "--tmpfs", "/tmp", "--perms", "0755",
            "--dir", "/job", "--", "/bin/true"]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap cannot run here: {e}"
    if done.returncode == 0:
        return None
    tail = " ".join(done.stderr.strip().splitlines()[-3:]) or f"exit code {done.returncode}"
    if "Unknown option" in tail or "not permitted in setuid mode" in tail:
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
        return (f"{version or 'this bubblewrap'} cannot build the sandbox ({tail}): it needs bubblewrap 0.7 or newer, "
                "not installed setuid")
    return f"bwrap cannot create namespaces here: {tail}"


def sandbox_uid() -> int | None:
    """The uid/gid the owner's code runs as: SANDBOX_UID_BASE + this process's pid when it is root (unique per
    worker process, so RLIMIT_NPROC, which the kernel counts per uid and does not enforce for root, bounds this
    sandbox alone); None when not root (then it runs as the caller's uid, and RLIMIT_NPROC counts all of that
    user's processes)."""
    return SANDBOX_UID_BASE + os.getpid() if os.geteuid() == 0 else None


# ---------------------------------------------------------------------------------------------------- GPUs

def _bus_key(bus_id: str) -> tuple[int, int, int, int] | None:
    """'00000000:17:00.0' (nvidia-smi) and '0000:17:00.0' (/proc/driver/nvidia/gpus) to one comparable key."""
    m = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])\s*", bus_id)
    return tuple(int(part, 16) for part in m.groups()) if m else None  # type: ignore[return-value]


def nvidia_devices(gpus: list[str], smi_csv: str, proc_information: dict[str, str]) -> tuple[list[str], list[str]]:
    """The /dev/nvidiaN device files of the GPUs `gpus` names (nvidia-smi indices or UUIDs, as the runner put them
    in CUDA_VISIBLE_DEVICES), and the ids to make visible inside (UUIDs when nvidia-smi gave them, else the ids).

    `smi_csv` is `nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader`; `proc_information` maps each
    directory name under /proc/driver/nvidia/gpus (a PCI bus id) to its `information` file."""
    rows = {}
    for line in smi_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            rows[parts[0]] = rows[parts[1]] = (parts[1], parts[2])
    minors = {}
    for bus, text in proc_information.items():
        m = re.search(r"^Device Minor:\s*(\d+)\s*$", text, re.MULTILINE)
        if m and _bus_key(bus) is not None:
            minors[_bus_key(bus)] = int(m.group(1))
    devices, visible = [], []
    for gpu in gpus:
        if gpu not in rows:
            raise SandboxError(f"GPU {gpu!r} is not one nvidia-smi lists (index or UUID): cannot give the job its "
                               "device file")
        uuid, bus = rows[gpu]
        minor = minors.get(_bus_key(bus))
        if minor is None:
            raise SandboxError(f"GPU {gpu!r} (PCI {bus}) has no 'Device Minor' in /proc/driver/nvidia/gpus: cannot "
                               "give the job its device file")
        devices.append(f"/dev/nvidia{minor}")
        visible.append(uuid or gpu)
    return devices, visible


def _read_gpu_facts() -> tuple[str, dict[str, str]]:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxError(f"the job has GPUs but nvidia-smi failed ({e}): cannot map them to device files") from e
    info = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc/driver/nvidia/gpus").iterdir():
            with contextlib.suppress(OSError):
                info[entry.name] = (entry / "information").read_text()
    return smi, info


# ---------------------------------------------------------------------------------------------------- filesystem

def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _system_args() -> list[str]:
    """The system directories read-only at their own paths; merged-usr symlinks (/bin -> usr/bin) as symlinks."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def python_dirs(exclude: Iterable[Path] = ()) -> list[str]:
    """The directories the interpreter and the gpuswarm packages need, to bind read-only at the same path.

    sys.path entries that are '' or the working directory, or that contain any of `exclude` (the node's state, the
    job's files), are left out. An entry that holds a gpuswarm package is left out too (a source checkout's root
    holds var/ with node state; each package directory is bound on its own) unless pip installed gpuswarm there
    (a `pip install --target` directory on PYTHONPATH, whose other packages the trainer imports)."""
    packages = []
    for name in PACKAGES:
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(name)
            packages += [os.path.abspath(p) for p in (spec.submodule_search_locations or [])] if spec else []
    cwd = os.getcwd()
    excluded = [os.path.abspath(p) for p in exclude]
    dirs = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        entry = os.path.abspath(entry)
        if entry == cwd or any(_is_under(g, entry) for g in excluded):
            continue
        if any(_is_under(p, entry) for p in packages) and not any(Path(entry).glob("gpuswarm-*.dist-info")):
            continue
        dirs.append(entry)
    dirs += packages
    found: list[str] = []
    for d in (os.path.abspath(d) for d in dirs):
        if os.path.isdir(d) and d not in found:
            found.append(d)
    return found


def _covered(path: str, binds: list[tuple[str, str]]) -> bool:
    """Whether a same-path bind of `path` would add nothing: an earlier bind shows it at this path already."""
    real = os.path.realpath(path)
    return any(src == dest and _is_under(path, dest) and _is_under(real, os.path.realpath(src)) for src, dest in binds)


def _hide_targets(hide: Iterable[Path], binds: list[tuple[str, str]]) -> list[tuple[str, bool]]:
    """Inside paths where a hidden host path would show through a bind: (inside path, is a directory)."""
    targets: list[tuple[str, bool]] = []
    for host in hide:
        host_paths = {os.path.abspath(host), os.path.realpath(host)}
        for src, dest in binds:
            for root in {src, os.path.realpath(src)}:
                for h in host_paths:
                    if _is_under(h, root) and os.path.lexists(h):
                        inside = os.path.normpath(dest + "/" + os.path.relpath(h, root))
                        item = (inside, os.path.isdir(h))
                        if item not in targets:
                            targets.append(item)
    return targets


def _depth(path: str) -> int:
    return len(Path(path).parts)


def command(argv: list[str], *, workdir: Path, readonly: dict[Path, str], hide: list[Path], gpus: list[str],
            limits: Limits, uid: int | None, env: dict[str, str], cgroup: Cgroup | None = None) -> list[str]:
    """The full command line that runs `argv` in one job's sandbox: `bwrap ... -- argv`, or with a `cgroup`,
    `sh -c 'echo $$ > CGROUP/cgroup.procs && exec "$@"' sh bwrap ... -- argv`.

    `workdir` is bound read-write at /job/work (the caller chowns it to `uid`); `readonly` maps more host paths
    (files or directories) to inside paths; `hide` (the node's state dir, its jobs dir, its cache) is covered with
    an empty tmpfs (or /dev/null, for a file) wherever a bind would show it. `gpus` are the host ids the runner
    chose (indices or UUIDs); only their /dev/nvidiaN are bound and CUDA_VISIBLE_DEVICES names them by UUID
    (empty: no GPU, CUDA_VISIBLE_DEVICES=""). `env` is the whole environment inside besides PATH and HOME (which it
    may override) and PYTHONPATH (`python_path`), PYTHON_SAFETY, CUDA_VISIBLE_DEVICES and GPUSWARM_SANDBOX (which
    it may not).

    The process is root inside until `enter` runs: PYTHON_SAFETY keeps /job/work and a user site off sys.path even
    for a plain `python -m` (`python_argv`)."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    if not argv:
        raise SandboxError("nothing to run in the sandbox")
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise SandboxError(f"the job's workdir {workdir} is not a directory")
    for src, inside in readonly.items():
        if not os.path.exists(src):
            raise SandboxError(f"{src}, to be shown read-only in the sandbox, does not exist")
        if not os.path.isabs(inside) or os.path.normpath(inside) in ("/", WORKDIR, "/proc", "/dev", "/tmp"):
            raise SandboxError(f"{src} cannot be shown at {inside!r} in the sandbox: give an absolute path of its own")

    ops: list[tuple[str, list[str]]] = []  # (inside path, bwrap arguments): mounted parents first, see below
    binds: list[tuple[str, str]] = []
    system = _system_args()
    for i in range(0, len(system), 3):
        ops.append((system[i + 2], system[i:i + 3]))
        if system[i] == "--ro-bind":
            binds.append((system[i + 1], system[i + 2]))
    interpreter_dirs = python_dirs(exclude=[workdir, *hide, *readonly])
    for d in interpreter_dirs:
        if not _covered(d, binds):
            ops.append((d, ["--ro-bind", d, d]))
            binds.append((d, d))
    tmpfs_size = ["--size", str(limits.memory_bytes)] if limits.memory_bytes else []
    ops += [("/proc", ["--proc", "/proc"]), ("/dev", ["--dev", "/dev"]),
            ("/dev/shm", ["--perms", "1777", *tmpfs_size, "--tmpfs", "/dev/shm"]),
            ("/tmp", ["--perms", "1777", *tmpfs_size, "--tmpfs", "/tmp"]),
            (WORKDIR, ["--bind", str(workdir), WORKDIR])]
    binds.append((str(workdir), WORKDIR))
    for src, inside in readonly.items():
        ops.append((inside, ["--ro-bind", str(src), inside]))
        binds.append((str(src), inside))
    for inside, is_dir in _hide_targets(hide, binds):
        # 0755, not bwrap's 0700: an interpreter directory below a hidden one must still be reachable.
        ops.append((inside, ["--perms", "0755", "--tmpfs", inside] if is_dir else ["--ro-bind", "/dev/null", inside]))
    visible: list[str] = []
    if gpus:
        devices, visible = nvidia_devices(list(gpus), *_read_gpu_facts())
        for dev in [*(d for d in NVIDIA_COMMON if os.path.exists(d)), *devices]:
            ops.append((dev, ["--dev-bind", dev, dev]))
    # bwrap makes missing parents of a mount point mode 0700 (root's): the sandbox uid could not reach /job/work or
    # /root/.pyenv/... So the parents that do not exist inside (in the sandbox's own root, or in a tmpfs such as a
    # hidden directory's) are made first, mode 0711: passable, not listable (the host's layout is none of the job's
    # business). A parent inside a bind exists already (it is the host's).
    mounted = {dest: "--tmpfs" in op or "--dir" in op for dest, op in ops}
    parents: list[str] = []
    for dest in list(mounted):
        for parent in map(str, reversed(Path(dest).parents[:-1])):  # "/a/b/c" -> "/a", "/a/b"
            if parent in mounted or parent in parents:
                continue
            holder = max((m for m in mounted if _is_under(parent, m)), key=len, default=None)
            if holder is None or mounted[holder]:
                parents.append(parent)
    ops += [(parent, ["--perms", "0711", "--dir", parent]) for parent in parents]
    # bwrap mounts in order, and a later mount covers an earlier one: parents go first, so a hidden directory's
    # tmpfs covers what a system bind shows of it, and a deeper bind (an interpreter directory) still shows through.
    # The sort is stable: at equal depth a hide, added last, wins.
    ops.sort(key=lambda op: _depth(op[0]))

    inner_env = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, **JOB_USER, **env, **python_path(interpreter_dirs),
                 **PYTHON_SAFETY, "CUDA_VISIBLE_DEVICES": ",".join(visible),
                 SANDBOX_ENV: json.dumps({"limits": asdict(limits), "uid": uid})}
    args = [bwrap, *NAMESPACES, "--hostname", "gpuswarm-sandbox", "--die-with-parent", "--new-session"]
    for _, op in ops:
        args += op
    args += ["--chmod", "0711", "/", "--clearenv"]
    for name, value in inner_env.items():
        args += ["--setenv", name, value]
    args += ["--chdir", WORKDIR, "--", *argv]
    if cgroup is not None:
        script = f"echo $$ > {shlex.quote(str(cgroup.path / 'cgroup.procs'))} && exec \"$@\""
        args = ["/bin/sh", "-c", script, "sh", *args]
    return args


def python_argv(module: str, *args: str) -> list[str]:
    """This interpreter running `module` without writing bytecode (-B). In the sandbox, `command`'s environment is
    all it sees: PYTHON_SAFETY keeps the working directory and a user site off sys.path, and PYTHONPATH is
    `python_path`'s."""
    return [sys.executable, "-B", "-m", module, *args]


def python_path(bound: Iterable[str]) -> dict[str, str]:
    """The node's PYTHONPATH for inside (gpuswarm installed with `pip install --target`, say): only its entries
    that are bound read-only (`bound`, from `python_dirs`). An empty or relative entry would put the working
    directory on sys.path while the process inside is still root, and an unbound one might name a directory the
    job can write (/job/work, /tmp)."""
    bound = {os.path.abspath(d) for d in bound}
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if os.path.isabs(p) and os.path.abspath(p) in bound]
    return {"PYTHONPATH": os.pathsep.join(path)} if path else {}


# ---------------------------------------------------------------------------------------------------- cgroup v2

@dataclass(frozen=True)
class Cgroup:
    """One sandbox's cgroup v2 group (created by `create_cgroup`)."""

    path: Path
    limits: Limits

    def _count(self, file: str, key: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / file).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        return 0

    def oom_kills(self) -> int:
        return self._count("memory.events", "oom_kill")

    def limit_reason(self) -> str | None:
        """Why the sandbox was stopped by one of its limits, if it was; else None."""
        if self.oom_kills():
            mib = (self.limits.memory_bytes or 0) / 2**20
            return f"the job ran out of its memory limit ({mib:.0f} MiB): the kernel's OOM killer ended it"
        if self._count("pids.events", "max"):
            return f"the job hit its process limit ({self.limits.processes} processes and threads)"
        return None

    def remove(self, timeout: float = 5.0) -> bool:
        """Kill what is left in the group and remove it; False (and a warning) when it would not go."""
        kill = self.path / "cgroup.kill"  # Linux 5.14+
        if kill.exists():
            with contextlib.suppress(OSError):
                kill.write_text("1")
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError as e:
                if time.monotonic() >= deadline:
                    logger.warning("could not remove the sandbox cgroup %s: %s", self.path, e)
                    return False
                time.sleep(0.05)


def cgroup_parent(proc_self_cgroup: str, fs_root: Path = Path("/"), need: Iterable[str] = ("memory", "pids"),
                  ) -> tuple[Path, set[str]] | None:
    """Where sandbox groups can be made, and the controllers enabled there; None without a usable cgroup v2.

    Usable: this process's v2 path ("0::/path" in /proc/self/cgroup) under a cgroup2 mount (/sys/fs/cgroup, or
    /sys/fs/cgroup/unified on a hybrid host), with `need` listed in cgroup.subtree_control and the directory
    writable. Tried: this process's own group (the daemon delegated a group with controllers to its children), then
    its parent (the daemon sits in a leaf of a delegated group, as with systemd's Delegate=yes; the sandbox becomes
    its sibling). `fs_root` is for tests."""
    rel = next((line[3:] for line in proc_self_cgroup.splitlines() if line.startswith("0::")), None)
    if rel is None:
        return None
    mount = next((m for m in (fs_root / "sys/fs/cgroup", fs_root / "sys/fs/cgroup/unified")
                  if (m / "cgroup.controllers").is_file()), None)
    if mount is None:
        return None
    own = mount / rel.strip().lstrip("/")
    for candidate in (own, own.parent) if own != mount else (own,):
        try:
            enabled = set((candidate / "cgroup.subtree_control").read_text().split())
        except OSError:
            continue
        if set(need) <= enabled and os.access(candidate, os.W_OK):
            return candidate, enabled
    return None


def create_cgroup(limits: Limits, parent: tuple[Path, set[str]], name: str | None = None) -> Cgroup:
    """Make the sandbox's group under `parent` (from `cgroup_parent`) and write its limits."""
    path = parent[0] / (name or f"{CGROUP_PREFIX}{os.getpid()}")
    if path.exists():  # a worker with this pid before us died without removing it
        Cgroup(path, limits).remove(timeout=1.0)
    path.mkdir()
    group = Cgroup(path, limits)
    try:
        writes = {"pids.max": str(limits.processes)}
        if limits.memory_bytes is not None:
            writes["memory.max"] = str(limits.memory_bytes)
            if (path / "memory.swap.max").exists():
                writes["memory.swap.max"] = "0"  # else the group swaps past memory.max instead of stopping
            if (path / "memory.oom.group").exists():
                writes["memory.oom.group"] = "1"  # an OOM ends the whole sandbox, not one random thread of it
        if limits.cpus is not None:
            if "cpu" in parent[1]:
                writes["cpu.max"] = f"{max(1000, round(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}"
            else:
                logger.warning("the cpu controller is not enabled in %s: the sandbox's CPU limit (%g cores) is not "
                               "enforced", parent[0], limits.cpus)
        for file, value in writes.items():
            (path / file).write_text(value)
    except OSError:
        group.remove(timeout=1.0)
        raise
    return group


@contextlib.contextmanager
def sandbox_cgroup(limits: Limits) -> Iterator[Cgroup | None]:
    """A cgroup v2 group for one sandbox while the block runs (then killed and removed), or None where this node
    has no usable cgroup v2 (the rlimits from `enter` are then the only limits). Pass it to `command`."""
    try:
        parent = cgroup_parent(Path("/proc/self/cgroup").read_text())
    except OSError:
        parent = None
    group = None
    if parent is not None:
        try:
            group = create_cgroup(limits, parent)
        except OSError as e:
            logger.warning("cannot make a cgroup for the sandbox under %s (%s); rlimits only", parent[0], e)
    try:
        yield group
    finally:
        if group is not None:
            group.remove()


# ---------------------------------------------------------------------------------------------------- inside

def _set_limit(which: int, value: int) -> None:
    soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)  # never raise a limit (a container may deny that even to root)
    resource.setrlimit(which, (value, value))


def _prctl(option: int, arg: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def capabilities() -> dict[str, int]:
    """This process's capability sets from /proc/self/status: CapInh, CapPrm, CapEff, CapBnd, CapAmb."""
    caps = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Cap"):
            name, _, value = line.partition(":")
            caps[name] = int(value.strip(), 16)
    return caps


def enter(limits: Limits, uid: int | None) -> None:
    """Become the sandboxed process: run first thing inside the sandbox, before any owner code is imported.

    Sets the rlimits (always; a cgroup's limits come on top), RLIMIT_CORE 0, then with a `uid`: empties the
    capability bounding set, drops the supplementary groups and becomes uid/gid `uid`, which clears every
    capability; then sets no_new_privs. Raises SandboxError if a capability is left."""
    if limits.memory_bytes is not None:
        _set_limit(resource.RLIMIT_DATA, limits.memory_bytes)
    _set_limit(resource.RLIMIT_NPROC, limits.processes)
    if limits.cpu_seconds is not None:
        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        value = limits.cpu_seconds if hard == resource.RLIM_INFINITY else min(limits.cpu_seconds, hard)
        # SIGXCPU at the soft limit (Python dies of it), SIGKILL a little later if that was caught.
        resource.setrlimit(resource.RLIMIT_CPU, (value, value + 5 if hard == resource.RLIM_INFINITY else value))
    _set_limit(resource.RLIMIT_FSIZE, limits.file_bytes)
    _set_limit(resource.RLIMIT_NOFILE, limits.open_files)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid is not None:
        try:
            last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        except (OSError, ValueError):
            last = 63
        with contextlib.suppress(OSError):  # needs CAP_SETPCAP (dropped last); a hardening, the uid change is the rule
            for cap in [c for c in range(last + 1) if c != CAP_SETPCAP] + [CAP_SETPCAP]:
                _prctl(PR_CAPBSET_DROP, cap)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        # Changing the uid clears the parent-death signal bwrap set; ask for it again.
        _prctl(PR_SET_PDEATHSIG, 9)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    left = {name: value for name, value in capabilities().items() if name in ("CapPrm", "CapEff", "CapAmb") and value}
    if left:
        raise SandboxError(f"the sandboxed process still has capabilities after entering: {left}")


def enter_from_environment() -> tuple[Limits, int | None]:
    """`enter` with the limits and uid `command` put in GPUSWARM_SANDBOX; returns them."""
    raw = os.environ.pop(SANDBOX_ENV, None)
    if raw is None:
        raise SandboxError(f"{SANDBOX_ENV} is not set: not started by gpuswarm.node.sandbox.command")
    spec = json.loads(raw)
    limits, uid = Limits(**spec["limits"]), spec["uid"]
    enter(limits, uid)
    return limits, uid
