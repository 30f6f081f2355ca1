"""A job's progress history (`JobProgress` rows) as a TensorBoard event file.

Owns the encoding (tensorboardX's protos, TFRecord framing), the name the file has among the job's artifacts, and
storing it there as an `Artifact` row the coordinator itself wrote (no node), its bytes a blob in the store
(`coordinator.store`). It reads points and writes one artifact; it never changes a job, and nothing here runs on the
event loop's thread for long: the encoding is a plain function, which callers run in an executor.

One event per point, at step = global_step and wall time = the point's `at`, with the scalars `loss`, `accuracy`
(when reported), `samples_per_second`, `peers` and `epoch`, and every metric the workload's evaluate reported
(under `metrics/NAME`). `tensorboard --logdir DIR` reads the file wherever its
name contains "tfevents".
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuswarm.coordinator import blobs
from gpuswarm.coordinator.db import Artifact, JobProgress
from gpuswarm.coordinator.store import BlobStore, put_bytes
from gpuswarm.proto.models import TENSORBOARD_ARTIFACT
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c

ARTIFACT_NAME = TENSORBOARD_ARTIFACT
SCALARS = ("loss", "accuracy", "samples_per_second", "peers", "epoch")


@dataclass(frozen=True)
class Point:
    """One progress point, detached from the database session (safe to hand to another thread)."""

    at: float
    epoch: float
    global_step: int
    loss: float | None
    accuracy: float | None
    samples_per_second: float
    peers: int
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.metrics is None:  # a row from before metrics were recorded
            object.__setattr__(self, "metrics", {})


def _record(data: bytes) -> bytes:
    """TFRecord framing: length (u64 little-endian), its masked CRC-32C, the data, the data's masked CRC-32C."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def encode(points: Iterable[Point], created_at: float) -> bytes:
    """The event file's bytes: the version record (at `created_at`), then one event per point."""
    out = [_record(Event(wall_time=created_at, file_version="brain.Event:2").SerializeToString())]
    for p in points:
        values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in
                  (("loss", p.loss), ("accuracy", p.accuracy), ("samples_per_second", p.samples_per_second),
                   ("peers", p.peers), ("epoch", p.epoch)) if value is not None]
        values += [Summary.Value(tag=f"metrics/{name}", simple_value=float(value))
                   for name, value in sorted(p.metrics.items())]
        event = Event(wall_time=p.at, step=p.global_step, summary=Summary(value=values))
        out.append(_record(event.SerializeToString()))
    return b"".join(out)


POINT_COLUMNS = (JobProgress.at, JobProgress.epoch, JobProgress.global_step, JobProgress.loss, JobProgress.accuracy,
                 JobProgress.samples_per_second, JobProgress.peers, JobProgress.metrics)


async def load_points(session: AsyncSession, job_id: str) -> list[Point]:
    """All of the job's points, by step (plain rows, no ORM objects: a long job has tens of thousands)."""
    rows = await session.execute(select(*POINT_COLUMNS).where(JobProgress.job_id == job_id)
                                 .order_by(JobProgress.global_step))
    return [Point(*row) for row in rows]


async def render(points: list[Point], now: float) -> bytes:
    """`encode` in an executor (about 25 us per point). A request handler calls it after closing its session: with
    SQLite, a session holds the coordinator's only connection. (`store` cannot: the file belongs to settlement.)"""
    return await asyncio.get_running_loop().run_in_executor(None, encode, points, now)


async def store(session: AsyncSession, job_id: str, blob_store: BlobStore, now: float) -> Artifact | None:
    """Write the job's event file into the blob store and record it among the job's artifacts, in the caller's
    transaction (which stays open while the file is encoded off the event loop). A job with no points gets no
    file. The file replaces an earlier one; should the transaction roll back, the next attempt writes it again
    (the bytes already stored are then unnamed, and the retention pass removes them)."""
    points = await load_points(session, job_id)
    if not points:
        return None
    data = await render(points, now)
    digest = await put_bytes(blob_store, data)
    await blobs.record_blob(session, digest, len(data), now)
    await session.execute(delete(Artifact).where(Artifact.job_id == job_id, Artifact.name == ARTIFACT_NAME))
    artifact = Artifact(job_id=job_id, name=ARTIFACT_NAME, node_id=None, sha256=digest, size=len(data),
                        final=False, accuracy=None, created_at=now)
    session.add(artifact)
    return artifact
