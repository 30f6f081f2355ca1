"""The node daemon's side of refereed re-execution (gpuswarm.proto.audits, decision 0030).

Owns answering the coordinator's audits of this node's rounds (uploading the evidence its training process kept:
gpuswarm.node.evidence) and refereeing other nodes' rounds: fetch the job's code and data and the evidence,
re-compute the round in a worker started as training is (`JobRunner.replay`: sandboxed, on free GPUs), and post
the signed verdict. Both run in the background, one task per audit, so heartbeats and training go on; a referee
task that fails for this node's own reasons (a download, a crash) sends no verdict, and the coordinator gives the
audit to another referee after its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from gpuswarm.client.api import ApiError
from gpuswarm.node.runner import JobInputs, JobRunner
from gpuswarm.proto.audits import AuditRequest, AuditVerdict, RefereeTask
from gpuswarm.proto.models import JobSpec

logger = logging.getLogger(__name__)
MAX_REPLAYS = 1  # rounds re-computed at a time: a referee's replay competes with this node's own training


class AuditDesk:
    def __init__(self, client, node_id: str, jobs_dir: Path, runner: JobRunner,
                 fetch_inputs: Callable[[str, JobSpec], Awaitable[JobInputs]]):
        self.client, self.node_id, self.jobs_dir, self.runner = client, node_id, jobs_dir, runner
        self.fetch_inputs = fetch_inputs
        self._tasks: dict[str, asyncio.Task] = {}  # audit id -> its upload or replay
        self._done: set[str] = set()
        self._replays = asyncio.Semaphore(MAX_REPLAYS)

    def on_poll(self, requests: list[AuditRequest], tasks: list[RefereeTask]) -> None:
        """Start what the assignment poll asked for and is not under way or done already."""
        for item, work in [*((r, self._answer) for r in requests), *((t, self._referee) for t in tasks)]:
            if item.audit_id in self._tasks or item.audit_id in self._done:
                continue
            task = asyncio.create_task(work(item), name=f"audit-{item.audit_id}")
            self._tasks[item.audit_id] = task
            task.add_done_callback(lambda _, audit_id=item.audit_id: self._tasks.pop(audit_id, None))

    def evidence_of(self, job_id: str, epoch: int) -> Path | None:
        """This node's evidence of its round of `epoch` in the job (under any of its assignments' workdirs)."""
        found = sorted(self.jobs_dir.glob(f"{job_id}-*/evidence/{epoch}.pt"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    async def _answer(self, request: AuditRequest) -> None:
        path = self.evidence_of(request.job_id, request.epoch)
        if path is None:
            self._done.add(request.audit_id)
            logger.warning("audit %s asks for round %d of %s, of which this node kept no evidence",
                           request.audit_id, request.epoch, request.job_id)
            return
        try:
            await self.client.upload_evidence(request.audit_id, path)
            self._done.add(request.audit_id)
            logger.info("audit %s: uploaded the evidence of round %d of %s", request.audit_id, request.epoch,
                        request.job_id)
        except (ApiError, OSError) as e:
            logger.warning("audit %s: could not upload the evidence (the next poll tries again): %s",
                           request.audit_id, e)

    async def _referee(self, task: RefereeTask) -> None:
        self._done.add(task.audit_id)  # one try: after its deadline the coordinator asks another referee
        workdir = self.jobs_dir / f"audit-{task.audit_id}"
        try:
            async with self._replays:
                inputs = await self.fetch_inputs(task.job_id, task.spec)
                workdir.mkdir(parents=True, exist_ok=True)
                evidence = workdir / "evidence.pt"
                await self.client.fetch_evidence(task.audit_id, task.evidence_sha256, evidence)
                logger.info("audit %s: re-computing node %s's round %d of %s", task.audit_id, task.node_id,
                            task.epoch, task.job_id)
                result = await self.runner.replay(task.spec, workdir, evidence, inputs)
            verdict = AuditVerdict(audit_id=task.audit_id, node_id=self.node_id, steps=result.get("steps") or 0,
                                   samples=result.get("samples") or 0, distance=result.get("distance"),
                                   passed=bool(result.get("passed")), reason=str(result.get("reason") or "")[:500])
            answer = await self.client.post_verdict(verdict)
            logger.info("audit %s: node %s's round %d %s (audit now %s)", task.audit_id, task.node_id, task.epoch,
                        "passed" if verdict.passed else f"FAILED: {verdict.reason}", answer.state)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - this node's trouble is no verdict on the other's round
            logger.warning("audit %s: could not referee node %s's round %d: %s", task.audit_id, task.node_id,
                           task.epoch, e)

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
