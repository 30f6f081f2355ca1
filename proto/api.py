"""Response models of the coordinator's /v1 API: what each route answers, field by field.

The request models (and the few answers that are also wire models: RegistrationResponse, MeshConfig, the GPU
challenge's ChallengeIssue, CommitAnswer and ChallengeResult) live in `proto.models` and `proto.challenge`; this
module holds the rest. Every field the coordinator sends is typed here. Fields a newer coordinator adds are kept
(extra="allow"), so an older client still parses the answer and its --json output still shows them. A job's spec
is read as the coordinator answers it (`JobSpecView`), never re-validated: a workload or hyper-parameter this
version does not know still reads. Enums (job and node states) are closed.

Pure pydantic and proto.models: no numpy, no hivemind, so the job owner's CLI can import it from a slim install.
"""

from __future__ import annotations

from typing import Any

from gpuswarm.proto.audits import AuditInfo, AuditRequest, RefereeTask
from gpuswarm.proto.models import Assignment, AssignmentState, JobState, NodeState, Resources
from gpuswarm.proto.signing import SignedEnvelope
from pydantic import BaseModel, ConfigDict, Field


class ApiModel(BaseModel):
    """Base of every response model: immutable, and fields this version does not know are kept as they came."""

    model_config = ConfigDict(extra="allow", frozen=True)


class StopView(ApiModel):
    target: str | None = None
    target_accuracy: float | None = None
    max_epochs: int | None = None
    max_steps: int | None = None
    max_seconds: float | None = None


class BlobRefView(ApiModel):
    """A job's code or dataset in the artifact store (`proto.models.CodeRef`, `DatasetRef`)."""

    sha256: str
    size: int
    format: str
    entrypoint: str | None = None  # code only
    name: str | None = None  # dataset only


class RequirementsView(ApiModel):
    min_gpu_memory_gb: float = 0.0
    gpu_models: list[str] = []
    allow_cpu: bool = True
    verified_only: bool = False


class JobSpecView(ApiModel):
    """A job's spec in an answer: what `proto.models.JobSpec` accepted at submit, typed but not re-checked against
    this version's workload catalogue, so that an answer from a newer coordinator still reads."""

    name: str = ""
    workload: str | None = None
    code: BlobRefView | None = None
    dataset: BlobRefView | None = None
    local_dataset: str | None = None  # federated: the nodes' own dataset of this name
    hyperparameters: dict[str, Any] = {}
    stop: StopView = StopView()
    training: dict[str, Any] = {}
    min_nodes: int = 1
    max_nodes: int = 1
    requirements: RequirementsView = RequirementsView()
    gpus_per_node: int = 1
    max_price_per_gpu_hour: float | None = None
    budget: float = 0.0

    @property
    def label(self) -> str:
        """What the job runs, in one word: the built-in workload's name or the owner's entrypoint."""
        return self.workload or (self.code.entrypoint if self.code and self.code.entrypoint else "custom code")


# ---------------------------------------------------------------------------------------------------- general


class Health(ApiModel):
    """GET /v1/health."""

    ok: bool
    version: str
    time: float  # the coordinator's clock
    leader: bool = False  # this coordinator runs matching, timeouts and settlement (one per database)


class DhtPeers(ApiModel):
    """GET /v1/dht: the DHT bootstrap peer's multiaddrs, and the authority key the swarm's DHT records chain to."""

    initial_peers: list[str]
    authority: str | None = None


# ---------------------------------------------------------------------------------------------------- node routes


class HeartbeatAnswer(ApiModel):
    """POST /v1/nodes/heartbeat. Every field has a default: the heartbeat is applied once the answer is 2xx, so
    an answer a newer coordinator shaped differently must not make the node think it was lost."""

    ok: bool = True
    server_time: float | None = None
    challenge: bool = False  # a GPU challenge is due: start one (POST /v1/challenges)
    certificate: SignedEnvelope | None = None  # a fresh DHT cert for the node's advert (gpuswarm.proto.dht)


class AssignmentList(ApiModel):
    """POST /v1/nodes/assignments: the node's active assignments, the audits of its rounds it must answer (upload
    the round's evidence), and the rounds of others it is to referee (gpuswarm.proto.audits)."""

    assignments: list[Assignment]
    audits: list[AuditRequest] = Field(default_factory=list)
    referee: list[RefereeTask] = Field(default_factory=list)


class AuditAnswer(ApiModel):
    """PUT /v1/audits/{audit_id}/evidence and POST /v1/audits/{audit_id}/verdict: the audit's state after it."""

    ok: bool = True
    audit_id: str
    state: str


class JobAudits(ApiModel):
    """GET /v1/jobs/{job_id}/audits: the job's audits, newest first."""

    job_id: str
    audits: list[AuditInfo]


class ClaimOutcome(ApiModel):
    node_id: str
    epoch: int
    status: str  # pending, credited or rejected
    credited_samples: int
    flag: str | None = None  # why the ledger distrusts the claim


class IgnoredClaim(ApiModel):
    node_id: str
    epoch: int
    reason: str


class RoundAnswer(ApiModel):
    """POST /v1/rounds (201). Defaults for the same reason as HeartbeatAnswer's: a 2xx means the report is stored,
    and a node that could not read the answer would keep resending it and hold up its outbox."""

    ok: bool = True
    claims: list[ClaimOutcome] = []
    ignored: list[IgnoredClaim] = []


class ArtifactStored(ApiModel):
    """PUT /v1/jobs/{job_id}/artifacts/{name} (201)."""

    ok: bool
    name: str
    size: int
    sha256: str


# ---------------------------------------------------------------------------------------------------- blobs


class BlobsMissing(ApiModel):
    """POST /v1/blobs/missing: those of the asked digests that this owner does not hold, in the order asked."""

    missing: list[str]


class BlobStored(ApiModel):
    """PUT /v1/blobs/{sha256} (201): the owner now holds the blob; `held_bytes` counts all the owner holds."""

    ok: bool
    sha256: str
    size: int
    held_bytes: int
    quota_bytes: int


# ---------------------------------------------------------------------------------------------------- nodes


class AdvertSummary(ApiModel):
    """The node's advert as the coordinator last read it from the DHT."""

    state: NodeState
    expires_at: float  # the DHT record's expiry
    maddrs: list[str]


class NodeInfo(ApiModel):
    """One node of GET /v1/nodes."""

    id: str
    state: NodeState
    online: bool
    resources: Resources
    software_version: str
    price_per_gpu_hour: float
    endpoints: list[str]
    registered_at: float
    last_seen: float | None = None
    revoked: bool
    mesh_address: str | None = None
    mesh_endpoints: list[str] | None = None
    verified: bool
    measured_gflops: float | None = None
    online_seconds: float
    advert: AdvertSummary | None = None
    job_id: str | None = None  # the first of job_ids
    job_ids: list[str]  # jobs the node holds an active assignment in
    reputation: float


class NodeList(ApiModel):
    """GET /v1/nodes, in registration order."""

    nodes: list[NodeInfo]


class RevokeAnswer(ApiModel):
    """POST /v1/nodes/{node_id}/revoke."""

    ok: bool
    node_id: str
    revoked: bool


class ChallengeRecord(ApiModel):
    id: str
    state: str  # issued, revealed, passed or failed
    device_class: str
    n: int
    time_limit: float
    issued_at: float
    finished_at: float | None = None
    seconds: float | None = None  # issue to commitment; None: never committed
    measured_gflops: float | None = None
    reason: str | None = None


class NodeChallenges(ApiModel):
    """GET /v1/nodes/{node_id}/challenges: the node's verification standing and latest challenges, newest first."""

    node_id: str
    verified: bool
    challenges_passed: int
    challenges_failed: int
    measured_gflops: float | None = None
    last_challenge_at: float | None = None
    next_challenge_at: float | None = None  # None: one is open
    challenges: list[ChallengeRecord]


# ---------------------------------------------------------------------------------------------------- jobs


class TrainingProgress(ApiModel):
    """A job's latest progress, as its nodes' heartbeats reported it. `metrics`: everything the workload's
    evaluate reported with it (val_bpb, perplexity, ...)."""

    epoch: float
    global_step: int
    accuracy: float | None = None
    loss: float | None = None
    samples_per_second: float
    peers: int
    metrics: dict[str, float] = {}


class JobInfo(ApiModel):
    """A job (POST /v1/jobs answers it, 201; POST /v1/jobs/{job_id}/cancel too)."""

    id: str
    name: str
    state: JobState
    spec: JobSpecView
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    progress: TrainingProgress
    final_accuracy: float | None = None
    final_metrics: dict[str, float] | None = None  # the final model's metrics, as its node reported them
    error: str | None = None
    owner_id: str
    dht_epoch: int | None = None  # hivemind's epoch, as the coordinator read it from the DHT


class JobSummary(JobInfo):
    """One job of GET /v1/jobs."""

    active_nodes: int


class JobList(ApiModel):
    """GET /v1/jobs: the owner's jobs, newest first."""

    jobs: list[JobSummary]


class AssignmentRecord(ApiModel):
    """A node's membership in a job, past or present."""

    node_id: str
    state: AssignmentState
    shard_index: int
    gpus: int
    price_per_gpu_hour: float  # the clearing price: the node's ask
    created_at: float
    ended_at: float | None = None
    reason: str | None = None


class ArtifactInfo(ApiModel):
    name: str
    size: int
    sha256: str
    final: bool
    accuracy: float | None = None
    node_id: str | None = None  # None: written by the coordinator (tensorboard.tfevents)
    created_at: float
    checkpoint_step: int | None = None  # set: a checkpoint of this global step
    metrics: dict[str, float] | None = None  # a final model's metrics


class ArtifactList(ApiModel):
    """GET /v1/jobs/{job_id}/artifacts: the job's artifacts, oldest first."""

    job_id: str
    artifacts: list[ArtifactInfo]


class JobEventInfo(ApiModel):
    at: float
    message: str


class ContributionSummary(ApiModel):
    """Per node and job: what it claimed, what was credited and paid (credits), how many claims are flagged."""

    node_id: str
    claims: int
    claimed_samples: int
    samples: int  # credited
    steps: int
    claimed_seconds: float
    compute_seconds: float  # credited
    paid: float
    flagged: int
    pending: int


class JobDetail(JobInfo):
    """GET /v1/jobs/{job_id}."""

    assignments: list[AssignmentRecord]
    artifacts: list[ArtifactInfo]
    contributions: list[ContributionSummary]
    events: list[JobEventInfo]  # the latest 50, oldest first


class JobContributions(ApiModel):
    """GET /v1/jobs/{job_id}/contributions."""

    job_id: str
    contributions: list[ContributionSummary]


class ProgressPoint(TrainingProgress):
    """One point of a job's training curve: its progress when it first reached `global_step`."""

    at: float


class ProgressCurve(ApiModel):
    """GET /v1/jobs/{job_id}/progress: one point per global step, oldest first."""

    job_id: str
    state: JobState
    points: list[ProgressPoint]
    truncated: bool  # more points follow: ask again with ?after= the last step


# ---------------------------------------------------------------------------------------------------- accounts


class OwnerCreated(ApiModel):
    """POST /v1/owners (201): the only answer that carries the owner's token."""

    id: str
    name: str
    token: str
    balance: float


class OwnerAccount(ApiModel):
    """GET /v1/owners/me and POST /v1/owners/{owner_id}/credits."""

    id: str
    name: str
    created_at: float
    balance: float


class LedgerLeg(ApiModel):
    """One leg of a ledger transfer, in credits (negative: out of `account`)."""

    at: float
    account: str
    amount: float
    kind: str  # reserve, pay, refund, adjust or grant
    job_id: str | None = None
    memo: str


class JobStatement(ApiModel):
    """GET /v1/jobs/{job_id}/statement: the money side of a job."""

    job_id: str
    state: JobState
    owner_id: str
    budget: float
    reserved: float
    paid: float
    refunded: float
    escrow: float
    settled: bool
    nodes: list[ContributionSummary]
    entries: list[LedgerLeg]  # the escrow account's legs


class NodeEarnings(ApiModel):
    job_id: str
    claims: int
    samples: int
    compute_seconds: float
    flagged: int
    earned: float


class NodeStatement(ApiModel):
    """GET /v1/nodes/{node_id}/statement: what a node was credited and paid, job by job."""

    node_id: str
    balance: float
    jobs: list[NodeEarnings]
    entries: list[LedgerLeg]


def dump(model: BaseModel | list[BaseModel]) -> Any:
    """A model (or a list of them) as the plain JSON value the API sent: what --json prints."""
    if isinstance(model, list):
        return [m.model_dump(mode="json") for m in model]
    return model.model_dump(mode="json")

