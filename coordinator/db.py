"""The coordinator's database: SQLAlchemy 2.0 models, engine set-up, and the nonce store against replays.

SQLite (a file under the data directory) is the default; PostgreSQL (asyncpg) works through DATABASE_URL. The
schema belongs to the migrations (`gpuswarm.coordinator.migrate`): after changing a model here, run
scripts/new-migration "what changed" and commit the revision it writes.
A filter on a list of values longer than IN_LIST_LIMIT (every online node) goes in `in_chunks`, one query each.
Times are stored as UNIX seconds (floats), which keeps them comparable with the nodes' signed timestamps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from gpuswarm.coordinator.errors import Conflict
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    delete,
    event,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.util import await_only

# Every constraint gets a predictable name, so a migration can drop or change it on any database (SQLite reports
# none of its own, and PostgreSQL invents others). Changing this renames constraints: it needs a migration too.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
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
    # Reputation inputs kept on the node (the rest are counted from assignments and claims).
    online_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    peer_rtt_ms: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # Peers the node has had no mesh path to for a while (its latest heartbeat): they need a relay.
    mesh_unreachable: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    # The GPU challenge (coordinator/challenge.py): verified = passed the latest one for the device it claims now.
    verified: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    challenges_passed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    challenges_failed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    measured_gflops: Mapped[float | None] = mapped_column(Float, nullable=True)  # 2n^3 / seconds to commit
    last_challenge_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    next_challenge_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # None: one is open


class MeshIPAM(Base):
    """The IPAM state (`gpuswarm.mesh.ipam`), one JSON row, changed only inside a write transaction."""

    __tablename__ = "mesh_ipam"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[dict[str, Any]]


class AuthorityKey(Base):
    """The swarm authority's Ed25519 private key (`gpuswarm.coordinator.authority`): one row, created once. In the
    database, so every coordinator of one PostgreSQL database signs DHT certs with the same key."""

    __tablename__ = "authority_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    private_key: Mapped[str] = mapped_column(String(64))  # raw 32 bytes, base64
    created_at: Mapped[float] = mapped_column(Float)


class Suspicion(Base):
    """A member's report that its reducer clipped another member of the job as a Byzantine outlier."""

    __tablename__ = "suspicions"

    job_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(16), primary_key=True)  # the suspect
    reporter: Mapped[str] = mapped_column(String(16), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)  # of the first report naming it
    at: Mapped[float] = mapped_column(Float)


class MeshRelay(Base):
    """A pair of nodes with no direct mesh path, and the node that forwards between them (`gpuswarm.mesh.relays`);
    written by the leader's tick only."""

    __tablename__ = "mesh_relays"

    node_a: Mapped[str] = mapped_column(String(16), primary_key=True)  # node_a < node_b
    node_b: Mapped[str] = mapped_column(String(16), primary_key=True)
    relay: Mapped[str] = mapped_column(String(16))
    since: Mapped[float] = mapped_column(Float)


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
    # BigInteger: proto's counts go up to 2**53; PostgreSQL's INTEGER stops at 2**31 - 1 (SQLite's has no limit).
    global_step: Mapped[int] = mapped_column(BigInteger, default=0)
    accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples_per_second: Mapped[float] = mapped_column(Float, default=0.0)
    peers: Mapped[int] = mapped_column(Integer, default=0)
    final_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    owner_id: Mapped[str] = mapped_column(ForeignKey("owners.id"), index=True)
    dht_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # hivemind's epoch, read from the DHT
    settled_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # escrow refunded, ledger closed
    # Everything the workload's evaluate reported with the latest progress (val_bpb, ...), and the final model's.
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    final_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class AssignmentRow(Base):
    __tablename__ = "assignments"
    __table_args__ = (Index("ix_assignments_node_state", "node_id", "state"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    state: Mapped[str] = mapped_column(String(16), index=True)  # the matcher and /metrics read the active ones
    shard_index: Mapped[int] = mapped_column(Integer)
    num_shards: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    gpus: Mapped[int] = mapped_column(Integer, default=1)  # GPUs (a CPU node: one slot) this assignment holds
    price_per_gpu_hour: Mapped[float] = mapped_column(Float, default=0.0)  # the clearing price (the node's ask)


class Contribution(Base):
    """One signed claim (`proto.models.ContributionClaim`), as received, and what the ledger made of it.

    A node signs one claim per round; (job, node, epoch) names it. A second, different claim under the same name
    is an equivocation: both versions are kept (the unique key includes the signature) and flagged, and at most
    one is credited. `status`: pending (waiting for a peer's attestation), credited, rejected."""

    __tablename__ = "contributions"
    __table_args__ = (UniqueConstraint("job_id", "node_id", "epoch", "signature"),
                      Index("ix_contributions_job_status", "job_id", "status"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    samples: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(BigInteger)
    compute_seconds: Mapped[float] = mapped_column(Float)
    window_start: Mapped[float] = mapped_column(Float)
    window_end: Mapped[float] = mapped_column(Float)
    solo: Mapped[bool] = mapped_column(Boolean, default=False)
    peer_id: Mapped[str] = mapped_column(String(128), default="", server_default="")  # its training process's
    signature: Mapped[str] = mapped_column(String(100))
    envelope: Mapped[dict[str, Any]]
    received_at: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    credited_samples: Mapped[int] = mapped_column(BigInteger, default=0)
    credited_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    paid: Mapped[int] = mapped_column(BigInteger, default=0)  # micro-credits
    flag: Mapped[str | None] = mapped_column(Text, nullable=True)  # why the ledger distrusts this claim


class Attestation(Base):
    """Node `attester` reported claim `claim_id` as received from a member of its round's group."""

    __tablename__ = "attestations"
    __table_args__ = (UniqueConstraint("claim_id", "attester"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    claim_id: Mapped[int] = mapped_column(ForeignKey("contributions.id"), index=True)
    attester: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    at: Mapped[float] = mapped_column(Float)


class Audit(Base):
    """A node's credited round drawn for refereed re-execution (`gpuswarm.coordinator.audits`): its evidence, the
    referee re-computing it, and the outcome. `deadline` is the current state's: evidence due, verdict due."""

    __tablename__ = "audits"
    __table_args__ = (Index("ix_audits_state", "state"),)

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)  # whose round
    epoch: Mapped[int] = mapped_column(BigInteger)
    claim_id: Mapped[int] = mapped_column(ForeignKey("contributions.id"), unique=True)
    state: Mapped[str] = mapped_column(String(16), default="requested")
    evidence_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    evidence_size: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    referee_id: Mapped[str | None] = mapped_column(String(16), nullable=True, index=True)  # the current referee
    referees: Mapped[list[str]] = mapped_column(JSON, default=list)  # those who gave a verdict, in order
    excluded: Mapped[list[str]] = mapped_column(JSON, default=list)  # referees who let their deadline pass
    failures: Mapped[int] = mapped_column(Integer, default=0)  # failed verdicts so far
    distance: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    requested_at: Mapped[float] = mapped_column(Float)
    deadline: Mapped[float] = mapped_column(Float)


class Owner(Base):
    """A job owner's account. The API token is stored only as its SHA-256 (tokens are 256-bit random strings,
    so a fast hash is enough; see docs/decisions)."""

    __tablename__ = "owners"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)


class LedgerEntry(Base):
    """One leg of a transfer, in integer micro-credits (exact sums). Every transfer writes two legs with the same
    `transfer`, one negative and one positive, so the sum over all entries is always zero (grants come from the
    `mint` account). An account's balance is the sum of its entries. Accounts: `owner:ID`, `escrow:JOB`,
    `node:ID`, `mint`."""

    __tablename__ = "ledger"
    __table_args__ = (Index("ix_ledger_account", "account"), Index("ix_ledger_job", "job_id"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    transfer: Mapped[str] = mapped_column(String(32), index=True)
    at: Mapped[float] = mapped_column(Float)
    account: Mapped[str] = mapped_column(String(48))
    amount: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(16))  # grant, adjust, reserve, pay, refund
    job_id: Mapped[str | None] = mapped_column(String(16), nullable=True)
    memo: Mapped[str] = mapped_column(Text, default="")


class Artifact(Base):
    """A named artifact of a job (model, checkpoint, TensorBoard file); its bytes are the blob `sha256` in the
    content-addressed store (coordinator/store.py), which keeps them while any artifact row names them."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    # The uploading node; None for an artifact the coordinator writes itself (the TensorBoard event file).
    node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id"), nullable=True)
    # Indexed: a node's fetch and the store's retention look artifacts up by digest.
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size: Mapped[int] = mapped_column(BigInteger)  # bytes; max_artifact_bytes may be set above 2 GiB
    final: Mapped[bool] = mapped_column(Boolean, default=False)
    accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    checkpoint_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # set: a checkpoint of this step
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # a final model's


class Blob(Base):
    """A blob in the content-addressed store (coordinator/store.py): its bytes exist there under `sha256` once
    this row is committed. `last_used_at` (an upload, a read, a job submitted with it) starts the retention clock
    (coordinator/blobs.py) once nothing references it."""

    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float)
    last_used_at: Mapped[float] = mapped_column(Float, index=True)


class BlobHolder(Base):
    """Owner `owner_id` uploaded the bytes of blob `sha256` itself: only then may it read the blob or name it in a
    job, and only then does it count against the owner's quota. The bytes are stored once, whoever holds them."""

    __tablename__ = "blob_holders"

    owner_id: Mapped[str] = mapped_column(ForeignKey("owners.id"), primary_key=True)
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"), primary_key=True, index=True)
    held_at: Mapped[float] = mapped_column(Float)


class JobBlob(Base):
    """Job `job_id`'s spec names blob `sha256` as its `role` (code or dataset): its assigned nodes may read it."""

    __tablename__ = "job_blobs"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"), primary_key=True, index=True)
    role: Mapped[str] = mapped_column(String(16))


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text)


class JobProgress(Base):
    """One point of a job's training curve: the first progress report that reached `global_step`.

    Written by the heartbeats (coordinator/heartbeats.py) when a report moves the job's step forward, so a job has
    at most one point per step. Read by GET /v1/jobs/{id}/progress and turned into the job's TensorBoard event file
    (coordinator/tensorboard.py). The unique key also serves as the index of job_id: lookups by job (and by job and
    step) use its leading column."""

    __tablename__ = "job_progress"
    __table_args__ = (UniqueConstraint("job_id", "global_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    at: Mapped[float] = mapped_column(Float)  # the coordinator's clock when the report arrived
    epoch: Mapped[float] = mapped_column(Float)
    global_step: Mapped[int] = mapped_column(BigInteger)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples_per_second: Mapped[float] = mapped_column(Float)
    peers: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # the workload's evaluate, if any


class Sweep(Base):
    """A hyper-parameter sweep (proto/sweeps.py): its spec and where it stands. Driven by coordinator/sweeps.py."""

    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    owner_id: Mapped[str] = mapped_column(ForeignKey("owners.id"), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)  # why it ended, when it did not complete


class SweepTrial(Base):
    """One trial of a sweep: its values, its job, the metric at each step the job reported, and the pruner's own
    bookkeeping (`system_attrs`), all that coordinator/search.py needs to rebuild the study."""

    __tablename__ = "sweep_trials"
    __table_args__ = (UniqueConstraint("sweep_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id"))
    number: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), nullable=True, unique=True)
    state: Mapped[str] = mapped_column(String(16))
    params: Mapped[dict[str, Any]]
    intermediate: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # str(epoch or step) -> metric
    last_step: Mapped[int] = mapped_column(BigInteger, default=-1)  # the job's last progress point read
    system_attrs: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    pruned_at_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Challenge(Base):
    """One GPU challenge (`proto.challenge`): issued -> revealed -> passed | failed, or issued -> failed (late, no
    answer, abandoned). Times are the coordinator's clock; the time bound runs from issued_at to committed_at."""

    __tablename__ = "challenges"
    __table_args__ = (Index("ix_challenges_state", "state"),)

    id: Mapped[str] = mapped_column(String(18), primary_key=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    state: Mapped[str] = mapped_column(String(16))
    device_class: Mapped[str] = mapped_column(String(128))
    n: Mapped[int] = mapped_column(Integer)
    seed: Mapped[str] = mapped_column(String(32))
    time_limit: Mapped[float] = mapped_column(Float)
    issued_at: Mapped[float] = mapped_column(Float)
    committed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    root: Mapped[str | None] = mapped_column(String(64), nullable=True)
    r_seed: Mapped[str | None] = mapped_column(String(32), nullable=True)
    rows: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    revealed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    measured_gflops: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class SeenNonce(Base):
    __tablename__ = "seen_nonces"

    nonce: Mapped[str] = mapped_column(String(32), primary_key=True)
    expires_at: Mapped[float] = mapped_column(Float, index=True)


WAL_SWITCH_SECONDS = 10.0


def _switch_to_wal(cursor) -> None:  # noqa: ANN001 - a DB-API cursor
    """Put the database file in WAL mode (the mode persists in the file), waiting out other connections.

    The switch needs an exclusive lock, and SQLite refuses it at once ("database is locked") while another
    connection holds the write lock, whatever busy_timeout says: two coordinators (or migrators) starting together
    on a new file met this in CI. So the switch is retried until another connection has made the file WAL or the
    lock is free. The hook runs in SQLAlchemy's greenlet on the event loop, so it waits with asyncio.sleep: a
    blocking sleep would also stop a lock holder on the same loop."""
    deadline = time.monotonic() + WAL_SWITCH_SECONDS
    while True:
        cursor.execute("PRAGMA journal_mode")
        if str(cursor.fetchone()[0]).lower() == "wal":
            return
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except Exception as e:  # the driver's OperationalError (sqlite3's, wrapped by the async adapter)
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
        await_only(asyncio.sleep(0.05))


T = TypeVar("T")
# Values in one `column.in_(...)` list. asyncpg refuses a query with more than 32,767 arguments (SQLite since 3.32
# takes 32,766 or more): a tick over 40,000 online nodes failed on PostgreSQL at its first such query.
IN_LIST_LIMIT = 10_000


def in_chunks(values: Iterable[T], size: int | None = None) -> Iterator[list[T]]:
    """`values` in lists of at most `size` (default IN_LIST_LIMIT), for one `column.in_(chunk)` query each."""
    size = size or IN_LIST_LIMIT
    values = list(values)
    for start in range(0, len(values), size):
        yield values[start:start + size]


def make_engine(url: str) -> AsyncEngine:
    # SQLite has one writer at a time. Several pooled connections would contend for its lock inside the database
    # (a deferred transaction that reads and then writes fails at once with "database is locked", and the busy
    # handler sleeps in coarse steps); one connection makes requests queue in the event loop instead, which is
    # fast and fair. Other processes (the CLI) still read through WAL and ride out writes with busy_timeout.
    single = {"pool_size": 1, "max_overflow": 0} if url.startswith("sqlite") and ":memory:" not in url else {}
    engine = create_async_engine(url, **single)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):  # noqa: ANN001 - DB-API types
            cursor = dbapi_connection.cursor()
            # WAL lets the CLI read while the service writes; busy_timeout rides out short write locks.
            cursor.execute("PRAGMA busy_timeout=5000")
            _switch_to_wal(cursor)
            cursor.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable at checkpoints, safe against corruption
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    return engine


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


async def remember_nonce(session: AsyncSession, nonce: str, expires_at: float) -> None:
    """Record a nonce inside the caller's transaction; a nonce seen before is a replay (409).

    Looks first, so that an ordinary replay never sends a failing INSERT: on PostgreSQL that aborts the whole
    transaction. Two copies racing each other still meet the primary key; the Conflict then ends the caller's
    transaction, which must not go on after it (on any database)."""
    if await session.get(SeenNonce, nonce) is not None:
        raise Conflict("replayed message: this nonce was already used", code="replay")
    session.add(SeenNonce(nonce=nonce, expires_at=expires_at))
    try:
        await session.flush()
    except IntegrityError:
        raise Conflict("replayed message: this nonce was already used", code="replay") from None


async def forget_expired_nonces(session: AsyncSession, now: float | None = None) -> None:
    await session.execute(delete(SeenNonce).where(SeenNonce.expires_at < (time.time() if now is None else now)))
