"""The coordinator's settings and the typed keys under which the app keeps its shared state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker


@dataclass
class CoordinatorConfig:
    data_dir: Path = Path("var/coordinator")
    database_url: str | None = None
    dht_host: str = "127.0.0.1"
    dht_port: int = 0
    dht_initial_peers: list[str] = field(default_factory=list)  # other coordinators' DHT peers (one database)
    blob_store_dir: Path | None = None  # default data_dir/blobs; coordinators of one database share one
    heartbeat_interval: float = 2.0
    node_timeout: float = 10.0  # a node silent this long is offline and loses its assignments
    advert_ttl: float = 30.0
    # DHT certs (coordinator/authority.py): how long a node's records stay valid without a word from here.
    dht_cert_ttl: float = 900.0
    max_json_bytes: int = 64 * 1024
    max_artifact_bytes: int = 512 * 1024 * 1024
    max_job_failures: int = 3
    loop_interval: float = 1.0
    start_dht: bool = True
    mesh_cidr: str = "10.77.0.0/16"  # gpuswarm.mesh.ipam.DEFAULT_CIDR; nodes' mesh addresses come from here
    mesh_poll_timeout: float = 20.0  # longest a peer-list long-poll is held open
    # GPU challenge (coordinator/challenge.py): at registration, then after exponential gaps with this mean.
    challenge_mean_interval: float = 1800.0
    challenge_min_interval: float = 60.0  # never sooner than this after the previous one ended
    challenge_proof_timeout: float = 120.0  # seconds from the reveal to the proof
    settle_grace: float = 30.0  # seconds after a job ends before its books close (late reports still count)
    audit_rate: float = 0.05  # the share of credited rounds re-computed by a referee (coordinator/audits.py)
    # The content-addressed store (coordinator/store.py, blobs.py): what one owner may hold, and how long a blob
    # nothing references is kept after its last use; the retention pass runs every blob_sweep_interval seconds.
    owner_quota_bytes: int = 20 * 1024**3
    blob_retention: float = 24 * 3600.0
    blob_sweep_interval: float = 60.0
    # Check node signatures in a child process (coordinator/sigcheck.py): another core than the event loop's. Off
    # in the dataclass, for apps built in-process (tests); `coordinator serve` turns it on where there are 2+ CPUs.
    signature_process: bool = False

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.data_dir / 'coordinator.db'}"

    @property
    def artifact_dir(self) -> Path:
        return self.data_dir / "artifacts"

    @property
    def blob_dir(self) -> Path:
        return self.blob_store_dir or self.data_dir / "blobs"

    @property
    def admin_token_file(self) -> Path:
        return self.data_dir / "admin.token"


CONFIG = web.AppKey("config", CoordinatorConfig)
SESSIONS = web.AppKey("sessions", async_sessionmaker[AsyncSession])
DHT_PEERS = web.AppKey("dht_peers", list)
WAKE = web.AppKey("wake", asyncio.Event)
ADVERTS = web.AppKey("adverts", dict)
NODE_PEERS = web.AppKey("node_peers", list)  # DHT multiaddrs of live registered nodes (app.node_peers)


DHT = web.AppKey("dht", object)  # the hivemind.DHT bootstrap peer, when started
MESH_VERSION = web.AppKey("mesh_version", object)  # coordinator.mesh.MeshVersion
ADMIN_TOKEN = web.AppKey("admin_token", str)
HEARTBEATS = web.AppKey("heartbeats", object)  # coordinator.heartbeats.HeartbeatBatcher
SIGNATURES = web.AppKey("signatures", object)  # coordinator.sigcheck.SignatureChecker, when config.signature_process
BLOBS = web.AppKey("blobs", object)  # coordinator.store.BlobStore: where artifact and blob bytes live
BLOB_LOCK = web.AppKey("blob_lock", asyncio.Lock)  # a blob's row and file change together: uploads vs retention
LEADERSHIP = web.AppKey("leadership", object)  # coordinator.leader.Leadership: whether this process runs the tick
AUTHORITY = web.AppKey("authority", object)  # coordinator.authority.Authority: signs the nodes' DHT certs
METRICS = web.AppKey("metrics", object)  # coordinator.metrics.CoordinatorMetrics (its registry is per app)
