"""The sandboxed trainer as the trusted worker sees it: starting it, asking it for work, and telling why it failed.

Owns launching `gpuswarm.node.trainer` (inside the job's bubblewrap sandbox, `gpuswarm.node.sandbox`, or as a plain
child process for a built-in workload on a node without bubblewrap), the shared parameter and gradient buffers
(created and sealed here, `gpuswarm.node.channel`), each request with its deadline, and checking every answer
(`gpuswarm.proto.trainer`). The trainer's stdout and stderr go to the worker's log through a bounded pump, so owners'
prints can neither fill the disk nor pose as the worker's events.

Whatever the trainer does (raises, hangs, exits, dies of a limit, answers nonsense, writes NaN into the output
buffer) ends as one `TrainerFailed` with a reason for the job's owner; the trainer is then killed.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gpuswarm.node import sandbox
from gpuswarm.node.channel import Channel, ChannelClosed, SharedTensor
from gpuswarm.proto.trainer import TRAINER_MESSAGE, Hello
from pydantic import ValidationError

logger = logging.getLogger(__name__)

LOG_LIMIT = 16 * 2**20  # bytes of the trainer's own output kept in the worker's log


class TrainerFailed(RuntimeError):
    """The job's workload failed; the message is the reason, for the job's owner."""


@dataclass(frozen=True)
class Inputs:
    code: Path | None = None
    dataset: Path | None = None
    checkpoint: Path | None = None


@dataclass(frozen=True)
class Settings:
    """How the node runs owners' code: sandboxed or not (only built-ins may run without), limits, deadlines."""

    sandboxed: bool = True
    limits: sandbox.Limits = sandbox.Limits()
    answer_timeout: float = 600.0  # seconds the trainer may take for one step, evaluation or save
    hide: tuple[Path, ...] = ()  # the node's state: never visible inside the sandbox


def _pump(fd: int, limit: int, tail: collections.deque) -> None:
    """Copy the trainer's output to this process's stderr (the job's worker.log), up to `limit` bytes, keeping its
    last lines in `tail` (for the reason of a crash that came before any answer). Raw reads and writes: this thread
    never holds a Python I/O lock, which a process hivemind forks from this one would inherit held, forever."""
    written, pending = 0, b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        if len(pending) > 8192:  # a very long line without an end: take it as it is
            lines.append(pending)
            pending = b""
        for raw in lines:
            tail.append(raw.decode(errors="replace").rstrip()[:300])
            if written < limit:
                line = b"trainer | " + raw + b"\n"
                written += len(line)
                if written >= limit:
                    line += b"trainer | (output over the log limit: the rest is dropped)\n"
                with contextlib.suppress(OSError):
                    os.write(2, line)


def _processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
    return found


def _reap(uid: int, timeout: float = 5.0) -> None:
    """Make sure nothing of a sandbox outlives it: the kernel kills its PID namespace when the sandbox's init
    exits, a moment after bwrap returns; anything still running as the sandbox's own uid then gets SIGKILL."""
    deadline = time.monotonic() + timeout
    while (left := _processes_of(uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
        if time.monotonic() > deadline - timeout / 2:
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    if left:
        logger.warning("%d process(es) of sandbox uid %d are still there after %.0fs", len(left), uid, timeout)


class TrainerLink:
    """A running trainer: `start` it, then `request` one answer at a time. `close` always ends it."""

    def __init__(self, workdir: Path, settings: Settings):
        self.settings = settings
        self.box = workdir / "sandbox"  # the trainer's only writable directory
        self.proc: subprocess.Popen | None = None
        self.chan: Channel | None = None
        self.params: SharedTensor | None = None
        self.out: SharedTensor | None = None
        self.hello: Hello | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=8)  # the trainer's last lines of output
        self._pump: threading.Thread | None = None
        self._resources = contextlib.ExitStack()
        self.cgroup: sandbox.Cgroup | None = None
        self.uid: int | None = None  # the sandbox's own uid, when it has one

    def start(self, spec: dict, inputs: Inputs, gpus: list[str], threads: int, nice: int) -> Hello:
        """Launch the trainer, have it build the workload, and map the shared buffers. The trainer's initial
        parameters are then in `self.params`."""
        # A fresh box: what an earlier run of this assignment left there belongs to another uid, and must not be
        # found by this run (a planted module, say).
        shutil.rmtree(self.box, ignore_errors=True)
        self.box.mkdir(parents=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = sandbox.python_argv("gpuswarm.node.trainer", "--channel-fd", str(theirs.fileno()))
        start = {"spec": spec, "threads": threads, "nice": nice}
        if self.settings.sandboxed:
            self.uid = uid = sandbox.sandbox_uid()
            if uid is not None:
                os.chown(self.box, uid, uid)
            readonly: dict[Path, str] = {}
            for key, path, inside in (("code", inputs.code, "/job/code"), ("dataset", inputs.dataset, "/job/data"),
                                      ("checkpoint", inputs.checkpoint, "/job/checkpoint.pt")):
                if path is not None:
                    if key == "dataset" and path.is_file():
                        inside = f"/job/data/{path.name}"  # a single-file dataset keeps its name (its suffix)
                    elif key == "code" and path.is_file():
                        inside = f"/job/code/{path.name}"  # a wheel keeps its name
                    readonly[path] = inside
                    start[key] = inside
            argv += ["--limits", json.dumps(asdict(self.settings.limits))]
            if uid is not None:
                argv += ["--uid", str(uid)]
            env = {"GPUSWARM_PARENT_PID": "0", "OMP_NUM_THREADS": str(threads)}
            # A cgroup v2 group with the limits where the node has one (removed, and its processes killed, on
            # close); the rlimits `sandbox.enter` sets inside apply either way.
            self.cgroup = self._resources.enter_context(sandbox.sandbox_cgroup(self.settings.limits))
            command = sandbox.command(argv, workdir=self.box, readonly=readonly, hide=list(self.settings.hide),
                                      gpus=gpus, limits=self.settings.limits, uid=uid, env=env, cgroup=self.cgroup)
            start["workdir"] = sandbox.WORKDIR
        else:
            command = argv
            start.update({k: str(v) for k, v in asdict(inputs).items() if v is not None}, workdir=str(self.box))
        self.proc = subprocess.Popen(
            command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=None if self.settings.sandboxed else
            os.environ | {"GPUSWARM_PARENT_PID": str(os.getpid()), "OMP_NUM_THREADS": str(threads)})
        theirs.close()
        self._pump = threading.Thread(target=_pump, args=(self.proc.stdout.fileno(), LOG_LIMIT, self.output),
                                      name="trainer-log", daemon=True)
        self._pump.start()
        self.chan = Channel(ours, send_timeout=self.settings.answer_timeout)
        self.chan.send(start)
        # Building the workload may load a dataset and compile: it gets twice the answer timeout.
        hello = self._answer("hello", 2 * self.settings.answer_timeout, "building the workload")
        numel = hello.numel()
        if 8 * numel > (self.settings.limits.memory_bytes or 2**62):
            raise TrainerFailed(f"the model has {numel:,} parameters; its shared buffers alone exceed this node's "
                                f"memory limit for a job")
        self.params, self.out = SharedTensor.create(numel, "params"), SharedTensor.create(numel, "out")
        self.chan.send({"op": "buffers"}, fds=[self.params.fd, self.out.fd])
        self._answer("ready", self.settings.answer_timeout, "mapping the shared buffers")
        self.hello = hello
        return hello

    def request(self, op: str, expect: str, what: str, *, extra_time: float = 0.0, **fields):
        """Send one request and return its validated answer (of kind `expect`); TrainerFailed otherwise. The answer
        may take the answer timeout plus `extra_time` seconds (a request of many inner steps asks for more)."""
        try:
            self.chan.send({"op": op, **fields})
        except TimeoutError:
            self.kill()
            raise TrainerFailed(f"the workload's process stopped reading its requests while {what}; it was "
                                f"stopped") from None
        except OSError:
            raise TrainerFailed(self._exit_reason(what)) from None
        return self._answer(expect, self.settings.answer_timeout + extra_time, what)

    def _answer(self, expect: str, timeout: float, what: str):
        try:
            raw, fds = self.chan.recv(timeout=timeout)
        except TimeoutError:
            self.kill()
            raise TrainerFailed(f"the workload did not answer within {timeout:.0f}s while {what} "
                                f"(this node's time limit for one request); it was stopped") from None
        except (ChannelClosed, OSError):
            raise TrainerFailed(self._exit_reason(what)) from None
        for fd in fds:
            os.close(fd)
        try:
            message = TRAINER_MESSAGE.validate_python(raw)
        except ValidationError as e:
            self.kill()
            raise TrainerFailed(f"the workload's process sent a malformed answer while {what}: "
                                f"{e.errors()[0]['msg'] if e.errors() else e}") from None
        if message.kind == "error":
            raise TrainerFailed(message.reason)
        if message.kind != expect:
            self.kill()
            raise TrainerFailed(f"the workload's process answered {message.kind!r} while {what}")
        return message

    def _exit_reason(self, what: str) -> str:
        """Why the channel closed: how the trainer's process ended (waiting a moment for it)."""
        code = None
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(5)
        limits = self.settings.limits
        if self.cgroup is not None and (why := self.cgroup.limit_reason()) is not None:
            return f"{why} while {what}"
        if code is None:
            return f"the workload's process closed its channel while {what}"
        if code < 0 or code in (128 + signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGXFSZ):
            sig = -code if code < 0 else code - 128
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            hint = {signal.SIGKILL: "killed (out of memory, or stopped by the node)",
                    signal.SIGXCPU: f"it used up its CPU time limit ({limits.cpu_seconds}s)",
                    signal.SIGXFSZ: f"it wrote a file over the size limit ({limits.file_bytes} bytes)"}.get(sig, "")
            return f"the workload's process died of {name} while {what}" + (f": {hint}" if hint else "")
        if self._pump is not None:
            self._pump.join(2)
        last = next((line for line in reversed(self.output) if line.strip()), "")
        return f"the workload's process exited with code {code} while {what}" + (f"; its last words: {last}"
                                                                                 if last and code != 0 else "")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)

    def take_file(self, name: str, limit: int, dest: Path | None = None) -> bytes | None:
        """A file the trainer wrote in its workdir, read without trusting it: a symlink, FIFO or device there is
        refused, never followed, and at most `limit` bytes are read. Copied to `dest` (a new file of this process)
        when given, else returned; the trainer's file is removed either way."""
        path = self.box / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise TrainerFailed(f"the workload's {name} cannot be opened: {e.strerror}") from None
        out = None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise TrainerFailed(f"the workload's {name} is not a regular file")
            if info.st_size > limit:
                raise TrainerFailed(f"the workload's {name} is {info.st_size} bytes, over the limit of {limit}")
            if dest is not None:
                dest.unlink(missing_ok=True)
                out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            chunks, taken = [], 0
            while chunk := os.read(fd, 1 << 20):
                taken += len(chunk)
                if taken > limit:
                    raise TrainerFailed(f"the workload's {name} grew over the limit of {limit} bytes")
                if out is None:
                    chunks.append(chunk)
                else:
                    os.write(out, chunk)
        finally:
            os.close(fd)
            if out is not None:
                os.close(out)
            with contextlib.suppress(OSError):
                path.unlink()
        return None if dest is not None else b"".join(chunks)

    def give_file(self, name: str, data: bytes) -> None:
        """Write `data` as a new file `name` in the trainer's workdir, readable by its uid. Whatever the trainer
        left under that name is removed first, and a name it re-creates in between (a symlink, say) makes the write
        fail instead of following it."""
        path = self.box / name
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise TrainerFailed(f"cannot hand the workload its {name}: {e.strerror}") from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the trainer to stop, then make sure it has: bounded, whatever state it is in."""
        if self.chan is not None:
            self.chan.send_timeout = 1.0
            with contextlib.suppress(OSError):
                self.chan.send({"op": "stop"})
        if self.proc is not None:
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self.kill()
        if self.uid is not None:
            _reap(self.uid)
        if self.chan is not None:
            self.chan.close()
        if self._pump is not None:
            self._pump.join(2)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        for buf in (self.params, self.out):
            if buf is not None:
                buf.close()
        self._resources.close()
