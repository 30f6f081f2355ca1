"""The job runner: one supervised child process per assigned job (`gpuswarm.node.worker`).

Owns starting a training process for an assignment, reading its JSON-line events, stopping it within a bounded
time (SIGTERM, then SIGKILL), and noticing when it crashed. A crash in a job never reaches the daemon: it becomes
a failure the daemon reports. The child asks for SIGTERM if the daemon itself dies (see `worker.die_with_parent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuswarm.node.identity import KEY_FILE
from gpuswarm.node.worker import EVENT_PREFIX, PARENT_PID_ENV
from gpuswarm.proto.models import Assignment, Progress

logger = logging.getLogger(__name__)


@dataclass
class RunningJob:
    assignment: Assignment
    process: asyncio.subprocess.Process
    workdir: Path
    started: float = field(default_factory=time.time)
    progress: Progress | None = None
    finished: dict | None = None  # the worker's "finished" event: the final model is saved
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=40))
    reader: asyncio.Task | None = None


EventHandler = Callable[[RunningJob, dict], None]


class JobRunner:
    def __init__(self, jobs_dir: Path, host: str, on_event: EventHandler, key_path: Path | None = None):
        self.jobs_dir, self.host, self.on_event = jobs_dir, host, on_event
        # The training process signs its round claims with the daemon's own key; jobs_dir is <state_dir>/jobs,
        # and the identity file lives in <state_dir>.
        self.key_path = key_path if key_path is not None else jobs_dir.parent / KEY_FILE
        self.running: dict[str, RunningJob] = {}

    async def start(self, assignment: Assignment) -> RunningJob:
        workdir = self.jobs_dir / f"{assignment.job_id}-{assignment.assignment_id}"
        workdir.mkdir(parents=True, exist_ok=True)
        spec_path = workdir / "assignment.json"
        spec_path.write_text(assignment.model_dump_json(indent=2))
        log = open(workdir / "worker.log", "ab")
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gpuswarm.node.worker", str(spec_path), "--host", self.host,
                "--workdir", str(workdir), "--key", str(self.key_path), stdout=asyncio.subprocess.PIPE, stderr=log,
                # No preexec_fn: forking a threaded daemon and running Python before exec can deadlock the child
                # while the parent's event loop waits for the exec. The worker sets its own parent-death signal.
                env=os.environ | {PARENT_PID_ENV: str(os.getpid())},
            )
        finally:
            log.close()
        job = RunningJob(assignment, process, workdir)
        job.reader = asyncio.create_task(self._read_events(job), name=f"events-{assignment.job_id}")
        self.running[assignment.job_id] = job
        logger.info("started training %s (shard %d/%d, pid %d)", assignment.job_id, assignment.shard_index,
                    assignment.num_shards, process.pid)
        return job

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
                if event.get("event") == "progress":
                    job.progress = Progress.model_validate(event)
                elif event.get("event") == "finished":
                    job.finished = event
                self.on_event(job, event)
            except Exception:  # one bad line never stops the reader
                logger.exception("ignoring bad event from %s: %.200s", job.assignment.job_id, line)

    def exited(self) -> list[tuple[RunningJob, int]]:
        """Jobs whose process has ended since the last call, with exit codes. They leave `running`."""
        done = [(job, job.process.returncode) for job in self.running.values() if job.process.returncode is not None]
        for job, _ in done:
            del self.running[job.assignment.job_id]
        return done

    def failure_reason(self, job: RunningJob, code: int) -> str:
        with contextlib.suppress(OSError):
            lines = (job.workdir / "worker.log").read_text(errors="replace").strip().splitlines()
            return f"training process exited with {code}: " + "\n".join(lines[-15:])
        return f"training process exited with {code}"

    async def stop(self, job_id: str, timeout: float = 10.0) -> None:
        job = self.running.get(job_id)
        if job is None:
            return
        if job.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                job.process.terminate()
            try:
                await asyncio.wait_for(job.process.wait(), timeout)
            except TimeoutError:
                logger.warning("training process of %s ignored SIGTERM for %.0fs; killing it", job_id, timeout)
                with contextlib.suppress(ProcessLookupError):
                    job.process.kill()
                await job.process.wait()
        if job.reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(job.reader, 2)
        logger.info("stopped training %s", job_id)

    async def stop_all(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(self.stop(job_id, timeout) for job_id in list(self.running)))
