"""The coordinator's database: SQLAlchemy 2.0 models, engine set-up, and the nonce store against replays.

SQLite (a file under the data directory) is the default; any SQLAlchemy async URL works through DATABASE_URL.
Times are stored as UNIX seconds (floats), which keeps them comparable with the nodes' signed timestamps.
"""

from __future__ import annotations

import time
from typing import Any

from gpuswarm.coordinator.errors import Conflict
from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint, delete, event
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    public_key: Mapped[str] = mapped_column(String(64), unique=True)
    resources: Mapped[dict[str, Any]]
    software_version: Mapped[str] = mapped_column(String(128))
    price_per_gpu_hour: Mapped[float] = mapped_column(Float, default=0.0)
    endpoints: Mapped[list[Any]]
    state: Mapped[str] = mapped_column(String(16))
    registered_at: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    online: Mapped[bool] = mapped_column(Boolean, default=True)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    # The mesh: WireGuard key, mesh address (from IPAM) and candidate endpoints, best first. Null without mesh.
    wg_public_key: Mapped[str | None] = mapped_column(String(44), nullable=True)
    mesh_address: Mapped[str | None] = mapped_column(String(64), nullable=True)
    mesh_endpoints: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)


class MeshIPAM(Base):
    """The IPAM state (`gpuswarm.mesh.ipam`), one JSON row, changed only inside a write transaction."""

    __tablename__ = "mesh_ipam"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[dict[str, Any]]


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The latest progress any member reported: what `job status` shows.
    epoch: Mapped[float] = mapped_column(Float, default=0.0)
    global_step: Mapped[int] = mapped_column(Integer, default=0)
    accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples_per_second: Mapped[float] = mapped_column(Float, default=0.0)
    peers: Mapped[int] = mapped_column(Integer, default=0)
    final_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class AssignmentRow(Base):
    __tablename__ = "assignments"
    __table_args__ = (Index("ix_assignments_node_state", "node_id", "state"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    state: Mapped[str] = mapped_column(String(16))
    shard_index: Mapped[int] = mapped_column(Integer)
    num_shards: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class Contribution(Base):
    """One signed claim, as received. The ledger is the sum of these per (job, node)."""

    __tablename__ = "contributions"
    __table_args__ = (UniqueConstraint("job_id", "node_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    seq: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer)
    compute_seconds: Mapped[float] = mapped_column(Float)
    rounds_joined: Mapped[int] = mapped_column(Integer)
    window_start: Mapped[float] = mapped_column(Float)
    window_end: Mapped[float] = mapped_column(Float)
    received_at: Mapped[float] = mapped_column(Float)
    envelope: Mapped[dict[str, Any]]


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(Integer)
    final: Mapped[bool] = mapped_column(Boolean, default=False)
    accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text)


class SeenNonce(Base):
    __tablename__ = "seen_nonces"

    nonce: Mapped[str] = mapped_column(String(32), primary_key=True)
    expires_at: Mapped[float] = mapped_column(Float, index=True)


def make_engine(url: str) -> AsyncEngine:
    engine = create_async_engine(url)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):  # noqa: ANN001 - DB-API types
            cursor = dbapi_connection.cursor()
            # WAL lets the CLI read while the service writes; busy_timeout rides out short write locks.
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=5000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    return engine


async def create_schema(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


async def remember_nonce(session: AsyncSession, nonce: str, expires_at: float) -> None:
    """Record a nonce inside the caller's transaction; a nonce seen before is a replay (409)."""
    session.add(SeenNonce(nonce=nonce, expires_at=expires_at))
    try:
        await session.flush()
    except IntegrityError:
        raise Conflict("replayed message: this nonce was already used", code="replay") from None


async def forget_expired_nonces(session: AsyncSession, now: float | None = None) -> None:
    await session.execute(delete(SeenNonce).where(SeenNonce.expires_at < (time.time() if now is None else now)))
