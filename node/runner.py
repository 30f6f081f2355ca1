"""The job runner: one supervised child process per assigned job (`gpuswarm.node.worker`).

Owns starting a training process for an assignment with its fetched inputs (code, dataset, checkpoint), giving it
the node's GPUs it may use (CUDA_VISIBLE_DEVICES: the job's share of the GPUs this node advertised, none on a
CPU node) and the sandbox settings for the job's code (sandboxed whenever this node can; a job with its owner's
code never runs otherwise), reading its JSON-line events, signing its claims with the node's key (the training
process never holds the key: it asks with a "sign" event and gets the envelope on its stdin, and only this
node's claims for that job are signed), stopping it within a bounded time (SIGTERM, then SIGKILL to its process
group: each training process leads its own, so its averagers, DHT and sandbox go with it), and noticing
when it crashed. A crash in a job never reaches the daemon: it becomes a failure the daemon reports, with the
reason the worker gave ("error" event) or its log's tail. The child asks for SIGTERM if the daemon itself dies
(see `worker.die_with_parent`). While the node is idle it keeps one worker started ahead (`keep_spare`), which
the next job is handed instead of a fresh process: its imports are done (decision 0032).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuswarm.node import sandbox
from gpuswarm.node.trainer_link import Settings
from gpuswarm.node.worker import EVENT_PREFIX, PARENT_PID_ENV, SPARE_FLAG, THREADS_ENV
from gpuswarm.proto.dht import binding_for
from gpuswarm.proto.models import PROGRESS_MARGIN, Assignment, ContributionClaim, JobSpec, Progress
from gpuswarm.proto.signing import SignedEnvelope

logger = logging.getLogger(__name__)
SPARE_DEATHS = 3  # spares that exit before any job takes them, after which jobs' workers start cold
REPLAY_TIMEOUT = 240.0  # seconds a referee's replay of one round may take (the coordinator waits 300)


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity, and its own cgroup v2 quota (a container's --cpus) if any."""
    cpus = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError, IndexError):
        group = Path("/proc/self/cgroup").read_text().splitlines()[0].split("::", 1)[1]
        quota, period = (Path("/sys/fs/cgroup") / group.lstrip("/") / "cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    return cpus


def torch_threads(job_gpus: int, node_gpus: int, cpus: int, quota: float | None) -> int:
    """Torch threads for a job's worker and trainer: the job's share of this machine's CPUs (on a CPU node, which
    runs one job, all but one, which the daemon, the DHT and the averagers need: two threads on two busy cores
    trained a third slower than one; on a GPU node, as many as the job holds of its GPUs), no more than the
    sandbox's CPU quota, at least one. The worker's CPU work (copying the gradients out, the inner optimizer,
    hivemind's accumulation) runs on these threads every step: one thread made it most of a GPU node's step time."""
    share = cpus - 1 if node_gpus <= 0 else cpus * min(job_gpus, node_gpus) // node_gpus
    if quota is not None:
        share = min(share, int(quota))
    return max(1, share)


@dataclass(frozen=True)
class JobInputs:
    """What the daemon fetched for a job before it starts: local paths, verified against the job's hashes."""

    code: Path | None = None  # the unpacked code directory or the wheel
    dataset: Path | None = None  # the dataset file or the unpacked directory
    checkpoint: Path | None = None  # the job's newest checkpoint, to resume from when no peer has the state


@dataclass
class RunningJob:
    assignment: Assignment
    process: asyncio.subprocess.Process
    workdir: Path
    gpus: tuple[int, ...] = ()
    started: float = field(default_factory=time.time)
    progress: Progress | None = None  # the latest
    history: deque[Progress] = field(default_factory=lambda: deque(maxlen=1024))  # the latest, newest last
    finished: dict | None = None  # the worker's "finished" event: the final model is saved
    error: str | None = None  # the worker's "error" event: why the workload failed
    reader: asyncio.Task | None = None
    ticket: SignedEnvelope | None = None  # the newest run ticket the coordinator gave for this assignment


def reportable(history: deque[Progress], claimed: int | None) -> Progress | None:
    """The newest progress a heartbeat may carry, given the highest epoch of the job's round reports the coordinator
    took. It takes a job's step only up to PROGRESS_MARGIN past its claims, and a heartbeat goes out before the
    claims of the same moment: a node that steps faster than it heartbeats would have every report dropped if it
    sent its latest. Before its first claim is taken the job's step is where this node began (0, or the step it
    resumed at). None: nothing within reach yet."""
    base = claimed if claimed is not None else (history[0].global_step if history else 0)
    limit = base + PROGRESS_MARGIN
    return next((p for p in reversed(history) if p.global_step <= limit), None)


EventHandler = Callable[[RunningJob, dict], None]
Signer = Callable[[dict], SignedEnvelope]


class JobRunner:
    def __init__(self, jobs_dir: Path, host: str, on_event: EventHandler, signer: Signer,
                 gpu_count: int = 0, settings: Settings = Settings(), max_hours: float | None = None,
                 binder: Signer | None = None, spare: bool = False):
        self.jobs_dir, self.host, self.on_event, self.signer = jobs_dir, host, on_event, signer
        # Signs a training process's DHT session-key binding (kind proto.dht.KEY_KIND); `authority` is the
        # coordinator's key, which the training process's DHT validators check every record against.
        self.binder, self.authority = binder, None
        # How jobs' code runs. The node's whole state dir (keys, database, cache, other jobs) is hidden from it.
        self.settings = dataclasses.replace(settings, hide=settings.hide + (jobs_dir.parent,))
        self.max_hours = max_hours
        # The GPUs this node advertised, numbered as the daemon's CUDA_VISIBLE_DEVICES lists them (if it is set).
        self.visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        self.gpu_count = min(gpu_count, len(self.visible)) if self.visible else gpu_count
        self.running: dict[str, RunningJob] = {}
        self._starting = asyncio.Lock()  # one start at a time: a GPU is reserved before the next start looks
        self.keeps_spare = spare  # keep a warm worker while idle (`keep_spare`)
        self.spare: asyncio.subprocess.Process | None = None
        self._spare_deaths = 0

    def free_gpus(self) -> list[int]:
        """GPUs no live training process holds (a process that exited frees its GPUs at once)."""
        held = {g for job in self.running.values() if job.process.returncode is None for g in job.gpus}
        return [g for g in range(self.gpu_count) if g not in held]

    async def start(self, assignment: Assignment, inputs: JobInputs = JobInputs()) -> RunningJob:
        async with self._starting:
            return await self._start(assignment, inputs)

    async def _start(self, assignment: Assignment, inputs: JobInputs) -> RunningJob:
        free = self.free_gpus()
        want = assignment.spec.gpus_per_node if self.gpu_count else 0
        if len(free) < want:
            raise OSError(f"the job needs {want} GPU(s) and only {len(free)} of this node's {self.gpu_count} are free")
        gpus = tuple(free[:want])
        cuda_ids = [self.visible[g] for g in gpus] if self.visible else [str(g) for g in gpus]
        workdir = self.jobs_dir / f"{assignment.job_id}-{assignment.assignment_id}"
        workdir.mkdir(parents=True, exist_ok=True)
        spec_path = workdir / "assignment.json"
        spec_path.write_text(assignment.model_dump_json(indent=2))
        args = [str(spec_path), "--host", self.host, "--workdir", str(workdir),
                *self._sandbox_args(assignment.spec)]
        if self.authority:
            args += ["--authority", self.authority]
        for flag, path in (("--code", inputs.code), ("--dataset", inputs.dataset), ("--checkpoint", inputs.checkpoint)):
            if path is not None:
                args += [flag, str(path)]
        # Only the job's GPUs are visible to it ("" on a CPU node: none, even if the machine has some).
        env = {"CUDA_VISIBLE_DEVICES": ",".join(cuda_ids), THREADS_ENV: self._threads(len(gpus))}
        process = await self._take_spare(args, env, workdir / "worker.log")
        warm = process is not None
        if process is None:
            log = open(workdir / "worker.log", "ab")
            try:
                process = await self._spawn_worker(args, env, log)
            finally:
                log.close()
        job = RunningJob(assignment, process, workdir, gpus, ticket=assignment.ticket)
        job.reader = asyncio.create_task(self._read_events(job), name=f"events-{assignment.job_id}")
        self.running[assignment.job_id] = job
        logger.info("started training %s (shard %d/%d, pid %d%s)", assignment.job_id, assignment.shard_index,
                    assignment.num_shards, process.pid, ", the warm spare" if warm else "")
        return job

    @staticmethod
    async def _spawn_worker(args: list[str], env: dict[str, str], log) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpuswarm.node.worker", *args, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=log,
            # No preexec_fn: forking a threaded daemon and running Python before exec can deadlock the child
            # while the parent's event loop waits for the exec. The worker sets its own parent-death signal.
            env=os.environ | {PARENT_PID_ENV: str(os.getpid())} | env,
            # Its own process group: `stop` can take down everything it started (hivemind's averager
            # processes, its DHT and p2pd, the sandboxed trainer) with one signal.
            start_new_session=True,
        )

    async def keep_spare(self) -> None:
        """Start a spare worker (`worker.wait_as_spare`) when this node runs no job and has none alive: the next
        job's worker is then already warm, about 6 CPU-seconds sooner (15 s under a 0.4 CPU quota). For the daemon
        to call while it is idle; the spare is spent by the next `start`. After SPARE_DEATHS spares in a row exited
        before a job took them, it stops trying (no restart loop of a spare that cannot start)."""
        if not self.keeps_spare or self.running:
            return
        if self.spare is not None:
            if self.spare.returncode is None:
                return
            self._spare_died(self.spare)
            if not self.keeps_spare:
                return
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        with open(self.jobs_dir / "spare.log", "wb") as log:
            self.spare = await self._spawn_worker([SPARE_FLAG], {}, log)

    async def _take_spare(self, args: list[str], env: dict[str, str], log: Path) -> asyncio.subprocess.Process | None:
        """The spare, handed this job (its arguments, environment and log); None if there is no live one."""
        spare, self.spare = self.spare, None
        if spare is None:
            return None
        if spare.returncode is not None:
            self._spare_died(spare)
            return None
        try:
            spare.stdin.write(json.dumps({"argv": args, "env": env, "log": str(log)}).encode() + b"\n")
            await spare.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):  # it died meanwhile: a job never waits on a spare
            kill_group(spare.pid)
            await spare.wait()
            self._spare_died(spare)
            return None
        self._spare_deaths = 0
        return spare

    def _spare_died(self, spare: asyncio.subprocess.Process) -> None:
        self.spare = None
        self._spare_deaths += 1
        if self._spare_deaths >= SPARE_DEATHS and self.keeps_spare:
            self.keeps_spare = False
            logger.warning("the spare worker exited %d times before a job took it (last exit code %s; see %s): "
                           "jobs' workers start cold from now on", self._spare_deaths, spare.returncode,
                           self.jobs_dir / "spare.log")

    async def drop_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None:
            kill_group(spare.pid)
            await spare.wait()

    def _threads(self, job_gpus: int) -> str:
        """GPUSWARM_TORCH_THREADS for a job's process: the operator's, else `torch_threads`."""
        return os.environ.get(THREADS_ENV) or str(torch_threads(job_gpus, self.gpu_count, usable_cpus(),
                                                                self.settings.limits.cpus))

    def _sandbox_args(self, spec: JobSpec) -> list[str]:
        """The worker's sandbox flags. A job with its owner's code is sandboxed or not run (OSError: the daemon
        refuses such jobs before this when the node cannot sandbox); a built-in runs unsandboxed only on a node
        without bubblewrap."""
        why = sandbox.unavailable_reason() if self.settings.sandboxed else "sandboxing is off on this node"
        if why is not None and spec.code is not None:
            raise OSError(f"this node does not run job owners' code without a sandbox: {why}")
        args = ["--sandbox" if why is None else "--no-sandbox",
                "--limits", json.dumps(dataclasses.asdict(self.settings.limits)),
                "--answer-timeout", str(self.settings.answer_timeout)]
        for path in self.settings.hide:
            args += ["--hide", str(path)]
        if self.max_hours:
            args += ["--max-hours", str(self.max_hours)]
        return args

    async def replay(self, spec: JobSpec, workdir: Path, evidence: Path, inputs: JobInputs,
                     timeout: float = REPLAY_TIMEOUT) -> dict:
        """Re-compute another node's round from its `evidence` with the job's workload, in a worker started as a
        training process is (`worker --replay`: sandboxed, on this node's free GPUs), and return its verdict
        event. OSError when the worker gave none within `timeout` seconds."""
        workdir.mkdir(parents=True, exist_ok=True)
        spec_path = workdir / "assignment.json"
        spec_path.write_text(json.dumps({"spec": spec.model_dump(mode="json")}))
        args = [str(spec_path), "--workdir", str(workdir), "--replay", str(evidence), *self._sandbox_args(spec)]
        for flag, path in (("--code", inputs.code), ("--dataset", inputs.dataset)):
            if path is not None:
                args += [flag, str(path)]
        gpus = self.free_gpus()[:spec.gpus_per_node if self.gpu_count else 0]
        with open(workdir / "worker.log", "ab") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gpuswarm.node.worker", *args, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
                env=os.environ | {PARENT_PID_ENV: str(os.getpid()), THREADS_ENV: self._threads(len(gpus)),
                                  "CUDA_VISIBLE_DEVICES": ",".join(self.visible[g] if self.visible else str(g)
                                                                   for g in gpus)})
        async def verdict() -> dict | None:
            async for raw in process.stdout:
                line = raw.decode(errors="replace")
                if line.startswith(EVENT_PREFIX):
                    with contextlib.suppress(ValueError):
                        event = json.loads(line[len(EVENT_PREFIX):])
                        if isinstance(event, dict) and event.get("event") == "verdict":
                            return event  # no need to wait for the worker's orderly exit
            return None

        try:
            result = await asyncio.wait_for(verdict(), timeout)
        except TimeoutError:
            result = None
        finally:
            kill_group(process.pid)  # the verdict is out (or late): nothing of the replay is needed any more
            await process.wait()
        if result is None:
            raise OSError(f"the replay gave no verdict (exit code {process.returncode}; see {workdir / 'worker.log'})")
        return result

    def _sign(self, job: RunningJob, event: dict) -> None:
        """Answer the worker's "sign" request: this node's claim for this job, signed; anything else refused."""
        try:
            claim = ContributionClaim.model_validate(event.get("payload"))
            if (claim.job_id, claim.node_id) != (job.assignment.job_id, job.assignment.node_id):
                raise ValueError(f"not this node's claim for job {job.assignment.job_id}")
            answer = {"id": event.get("id"), "envelope": self.signer(claim.model_dump(mode="json"))
                      .model_dump(mode="json")}
        except Exception as e:  # noqa: BLE001 - the worker gets the reason; its round carries no claim
            answer = {"id": event.get("id"), "error": str(e)[:300]}
        self._answer(job, answer)

    def _bind(self, job: RunningJob, event: dict) -> None:
        """Answer the worker's "bind" request: the newest run ticket for its job, and this node's binding of the
        worker's DHT session key to it, for the subkeys it names (at most the binding's limit)."""
        try:
            if job.ticket is None or self.binder is None:
                raise ValueError("the coordinator gave no DHT ticket for this job")
            subkeys = [base64.b64decode(s, validate=True) for s in event.get("subkeys") or []]
            payload = binding_for(job.ticket, str(event.get("session_key")), subkeys)
            answer = {"id": event.get("id"), "cert": job.ticket.model_dump(mode="json"),
                      "binding": self.binder(payload).model_dump(mode="json")}
        except Exception as e:  # noqa: BLE001 - the worker gets the reason
            answer = {"id": event.get("id"), "error": str(e)[:300]}
        self._answer(job, answer)

    @staticmethod
    def _answer(job: RunningJob, answer: dict) -> None:
        if job.process.stdin is not None and not job.process.stdin.is_closing():
            job.process.stdin.write(json.dumps(answer).encode() + b"\n")

    async def _read_events(self, job: RunningJob) -> None:
        stdout = job.process.stdout
        if stdout is None:
            return
        async for raw in stdout:
            line = raw.decode(errors="replace").rstrip()
            if not line.startswith(EVENT_PREFIX):
                continue
            try:
                event = json.loads(line[len(EVENT_PREFIX):])
                if event.get("event") == "sign":
                    self._sign(job, event)
                    continue
                if event.get("event") == "bind":
                    self._bind(job, event)
                    continue
                if event.get("event") == "progress":
                    job.progress = Progress.model_validate(event)
                    job.history.append(job.progress)
                elif event.get("event") == "finished":
                    job.finished = event
                elif event.get("event") == "error":
                    job.error = str(event.get("reason", ""))[:1500]
                self.on_event(job, event)
            except Exception:  # one bad line never stops the reader
                logger.exception("ignoring bad event from %s: %.200s", job.assignment.job_id, line)

    def exited(self) -> list[tuple[RunningJob, int]]:
        """Jobs whose process has ended since the last call, with exit codes. They leave `running`, and whatever
        their process left behind in its group is killed."""
        done = [(job, job.process.returncode) for job in self.running.values() if job.process.returncode is not None]
        for job, _ in done:
            del self.running[job.assignment.job_id]
            kill_group(job.process.pid)
        return done

    def failure_reason(self, job: RunningJob, code: int) -> str:
        if job.error:
            return f"the job's workload failed: {job.error}"
        with contextlib.suppress(OSError):
            lines = (job.workdir / "worker.log").read_text(errors="replace").strip().splitlines()
            return f"training process exited with {code}: " + "\n".join(lines[-15:])
        return f"training process exited with {code}"

    async def stop(self, job_id: str, timeout: float = 10.0) -> None:
        """SIGTERM the training process; after `timeout` seconds SIGKILL its whole process group."""
        job = self.running.get(job_id)
        if job is None:
            return
        if job.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                job.process.terminate()
            try:
                await asyncio.wait_for(job.process.wait(), timeout)
            except TimeoutError:
                logger.warning("training process of %s did not stop %.1fs after SIGTERM; killing it", job_id, timeout)
                kill_group(job.process.pid)
                await job.process.wait()
        kill_group(job.process.pid)  # its averagers, DHT and trainer, if they outlived it
        if job.reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(job.reader, 1)
        logger.info("stopped training %s", job_id)

    async def stop_all(self, timeout: float = 10.0) -> None:
        await asyncio.gather(self.drop_spare(), *(self.stop(job_id, timeout) for job_id in list(self.running)))


def kill_group(pgid: int) -> None:
    """SIGKILL a training process's group (it leads its own session, see `JobRunner._start`)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
