"""Who holds, references and may read which blob, and when a blob is removed: the database side of the store.

Owns the rules of docs/decisions/0013-content-addressed-artifact-store.md as queries on `Blob`, `BlobHolder`,
`JobBlob` and `Artifact`: an owner holds a blob only after uploading its bytes itself (`record_upload`); a job may
name only blobs its owner holds (`reference`); a node reads only the code, dataset and artifacts of a job it holds
an active assignment in (`node_may_read`); a job keeps its newest checkpoints (`prune_checkpoints`); the retention
pass removes blobs nothing references and nobody used for `blob_retention` seconds (`sweep`), rows and bytes; and
artifact files of an older data directory are moved into the store at start (`adopt_legacy_artifacts`). The bytes
themselves are `store.BlobStore`'s; HTTP is the views'.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from gpuswarm.coordinator.db import Artifact, AssignmentRow, Audit, Blob, BlobHolder, Job, JobBlob
from gpuswarm.coordinator.errors import Conflict, Forbidden
from gpuswarm.coordinator.store import BlobStore, LocalBlobStore
from gpuswarm.proto.models import AssignmentState, CheckpointRef, CodeRef, JobSpec, JobState
from sqlalchemy import delete, exists, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

logger = logging.getLogger(__name__)
OPEN_STATES = (JobState.PENDING.value, JobState.RUNNING.value)


def _insert(session: AsyncSession, table):
    """INSERT ... ON CONFLICT for the two supported databases."""
    return (postgresql if session.bind.dialect.name == "postgresql" else sqlite).insert(table)


async def held_bytes(session: AsyncSession, owner_id: str) -> int:
    """What the owner holds, in bytes: the sum of the sizes of the blobs it uploaded (each counted once)."""
    total = await session.scalar(select(func.coalesce(func.sum(Blob.size), 0)).join(
        BlobHolder, BlobHolder.sha256 == Blob.sha256).where(BlobHolder.owner_id == owner_id))
    return int(total or 0)


async def holdings(session: AsyncSession, owner_id: str, shas: Sequence[str]) -> dict[str, int]:
    """Those of `shas` the owner holds, with their sizes."""
    if not shas:
        return {}
    rows = await session.execute(select(Blob.sha256, Blob.size).join(BlobHolder, BlobHolder.sha256 == Blob.sha256)
                                 .where(BlobHolder.owner_id == owner_id, Blob.sha256.in_(list(set(shas)))))
    return {sha: size for sha, size in rows}


async def record_blob(session: AsyncSession, sha256: str, size: int, now: float) -> None:
    """The store has blob `sha256` (committed under BLOB_LOCK): its row exists, used now."""
    await session.execute(_insert(session, Blob).values(sha256=sha256, size=size, created_at=now, last_used_at=now)
                          .on_conflict_do_update(index_elements=["sha256"], set_={"last_used_at": now}))


async def record_upload(session: AsyncSession, owner_id: str, sha256: str, size: int, now: float) -> None:
    """Owner `owner_id` uploaded the bytes of `sha256`: from now on it holds the blob."""
    await record_blob(session, sha256, size, now)
    await session.execute(_insert(session, BlobHolder).values(owner_id=owner_id, sha256=sha256, held_at=now)
                          .on_conflict_do_nothing(index_elements=["owner_id", "sha256"]))


async def touch(session: AsyncSession, shas: Sequence[str], now: float) -> None:
    """The blobs were used now: their retention clock starts again."""
    if shas:
        await session.execute(update(Blob).where(Blob.sha256.in_(list(shas))).values(last_used_at=now))


def _what(ref, spec: JobSpec) -> str:
    return "code" if isinstance(ref, CodeRef) or ref is spec.code else "dataset"


async def reference(session: AsyncSession, job: Job, spec: JobSpec, now: float) -> None:
    """Record the blobs `spec` names as the job's, after checking that the job's owner holds each of them, with
    the size the spec says (409 `blob_not_held` / `blob_size_mismatch` otherwise)."""
    refs = spec.blob_refs()
    held = await holdings(session, job.owner_id, [r.sha256 for r in refs])
    for ref in refs:
        what = _what(ref, spec)
        if ref.sha256 not in held:
            raise Conflict(f"upload the job's {what} (sha256 {ref.sha256[:12]}…) first: gpuswarm job submit uploads "
                           f"it", code="blob_not_held")
        if held[ref.sha256] != ref.size:
            raise Conflict(f"the job's {what} (sha256 {ref.sha256[:12]}…) is {held[ref.sha256]} bytes in the store, "
                           f"but the spec says {ref.size}", code="blob_size_mismatch")
    roles: dict[str, str] = {}
    for ref in refs:
        roles.setdefault(ref.sha256, _what(ref, spec))  # code and dataset may be the same bytes: one row
    for sha, role in roles.items():
        session.add(JobBlob(job_id=job.id, sha256=sha, role=role))
    await touch(session, list(roles), now)


async def node_may_read(session: AsyncSession, job: Job, node_id: str, sha256: str) -> None:
    """A node reads a blob only while it holds an active assignment in the job, and only the job's own blobs:
    its code, its dataset, its artifacts (checkpoints, models); or while it referees a round of the job (an audit
    assigned to it), and then only the job's code and dataset. 403 `not_assigned` / `not_a_job_blob`."""
    active = await session.scalar(select(AssignmentRow.id).where(
        AssignmentRow.job_id == job.id, AssignmentRow.node_id == node_id,
        AssignmentRow.state == AssignmentState.ACTIVE.value).limit(1))
    referee = active is None and await session.scalar(select(Audit.id).where(
        Audit.job_id == job.id, Audit.referee_id == node_id, Audit.state == "assigned").limit(1)) is not None
    if active is None and not referee:
        raise Forbidden(f"node {node_id} holds no active assignment in job {job.id}", code="not_assigned")
    named = exists().where(JobBlob.job_id == job.id, JobBlob.sha256 == sha256)
    if not referee:
        named = named | exists().where(Artifact.job_id == job.id, Artifact.sha256 == sha256)
    named = await session.scalar(select(named))
    if not named:
        raise Forbidden(f"{sha256[:12]}… is not the code, dataset or an artifact of job {job.id}",
                        code="not_a_job_blob")


# ---------------------------------------------------------------------------------------------------- checkpoints


async def prune_checkpoints(session: AsyncSession, job_id: str, kept: int) -> list[str]:
    """Delete all but the newest `kept` checkpoint artifacts of the job (by step, then upload time). Returns the
    names deleted; their bytes go with the retention pass once nothing else names them."""
    rows = (await session.scalars(select(Artifact).where(
        Artifact.job_id == job_id, Artifact.checkpoint_step.is_not(None))
        .order_by(Artifact.checkpoint_step.desc(), Artifact.created_at.desc(), Artifact.id.desc()))).all()
    for old in rows[kept:]:
        await session.delete(old)
    return [a.name for a in rows[kept:]]


async def latest_checkpoints(session: AsyncSession, job_ids: Sequence[str],
                             banned: dict[str, set[str]]) -> dict[str, CheckpointRef]:
    """Each job's newest checkpoint (highest step), for the assignments the nodes poll; never one uploaded by a node
    `banned` from the job ({job: nodes}): a node convicted of cheating may have written its checkpoints too, and the
    nodes that take the job over would resume from them."""
    if not job_ids:
        return {}
    rows = (await session.scalars(select(Artifact).where(
        Artifact.job_id.in_(list(set(job_ids))), Artifact.checkpoint_step.is_not(None))
        .order_by(Artifact.job_id, Artifact.checkpoint_step.desc(), Artifact.created_at.desc()))).all()
    newest: dict[str, CheckpointRef] = {}
    for a in rows:
        if a.node_id not in banned.get(a.job_id, ()):
            newest.setdefault(a.job_id, CheckpointRef(name=a.name, sha256=a.sha256, size=a.size,
                                                      step=a.checkpoint_step))
    return newest


# ---------------------------------------------------------------------------------------------------- retention


async def sweep(sessions: async_sessionmaker[AsyncSession], store: BlobStore, lock: asyncio.Lock, now: float,
                retention: float) -> list[str]:
    """Remove the blobs nothing keeps, rows (holders, references of ended jobs, the blob) and bytes. A blob is
    kept while an artifact names it, while an open job names it, and for `retention` seconds after its last use
    or the end of the last job that named it. Returns the digests removed."""
    cutoff = now - retention
    kept_by_job = exists().where(JobBlob.sha256 == Blob.sha256, JobBlob.job_id == Job.id,
                                 or_(Job.state.in_(OPEN_STATES), Job.finished_at.is_(None),
                                     Job.finished_at >= cutoff))
    async with lock:
        async with sessions.begin() as session:
            doomed = list((await session.scalars(select(Blob.sha256).where(
                Blob.last_used_at < cutoff, ~exists().where(Artifact.sha256 == Blob.sha256), ~kept_by_job)
                .limit(1000))).all())
            if doomed:
                await session.execute(delete(BlobHolder).where(BlobHolder.sha256.in_(doomed)))
                await session.execute(delete(JobBlob).where(JobBlob.sha256.in_(doomed)))
                await session.execute(delete(Blob).where(Blob.sha256.in_(doomed)))
        for sha in doomed:  # after the commit: a failed commit leaves the bytes of rows that still exist
            await store.delete(sha)
    if doomed:
        logger.info("retention: removed %d blob(s) unused for %.0fs", len(doomed), retention)
    return doomed


# ---------------------------------------------------------------------------------------------------- older data


async def adopt_legacy_artifacts(sessions: async_sessionmaker[AsyncSession], store: BlobStore, artifact_dir: Path,
                                 now: float) -> int:
    """Move the artifact files of an older data directory (ARTIFACT_DIR/JOB/NAME) into the store, once: each
    artifact row whose blob has no row yet is adopted if its file holds the bytes the row names. Returns how many
    were adopted; a missing or altered file is logged and left alone (its download answers 404)."""
    async with sessions() as session:
        orphans = (await session.execute(select(Artifact.job_id, Artifact.name, Artifact.sha256, Artifact.size).where(
            ~exists().where(Blob.sha256 == Artifact.sha256)))).all()
    adopted = 0
    for job_id, name, sha256, size in orphans:
        source = artifact_dir / job_id / name
        if not source.is_file():
            if not await store.exists(sha256):
                logger.warning("artifact %s/%s: its file %s is missing", job_id, name, source)
                continue
        elif isinstance(store, LocalBlobStore):
            if not await store.adopt(sha256, source):
                logger.warning("artifact %s/%s: %s does not hold the bytes its row names; left there", job_id, name,
                               source)
                continue
        else:
            async def chunks(path: Path = source):
                with open(path, "rb") as f:
                    while chunk := await asyncio.to_thread(f.read, 1 << 20):
                        yield chunk
            try:
                await store.write(sha256, size, chunks())
            except Exception as e:  # noqa: BLE001 - logged, the rest are adopted still
                logger.warning("artifact %s/%s: not adopted (%s)", job_id, name, e)
                continue
            source.unlink()
        async with sessions.begin() as session:
            await record_blob(session, sha256, size, now)
        adopted += 1
    if adopted:
        logger.info("moved %d artifact file(s) of an older data directory into the blob store", adopted)
    return adopted
