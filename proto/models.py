"""Wire models: everything a node, the coordinator and a job owner say to each other.

Fields are bounded (no NaN, no negative counts, capped lengths and list sizes). What nodes and the coordinator say
to each other (`WireModel`) ignores unknown extra fields, so that a newer peer can still talk to an older one, and
pydantic's lax mode still coerces its types. What job owners and operators send (`JobSpec` with its `StopRule` and
`Requirements`, `NewOwner`, `CreditAdjustment`) is strict instead (`proto.strict.OwnerModel`): an unknown key or a
wrong type is an error naming the key, so that `budgett = 5` is refused rather than silently dropped. A job spec
relayed onward to a node in its `Assignment` is read as `RelayedJobSpec`, which drops the
keys this version does not know. Validation errors are the caller's to map (`proto.strict.error_details`).
"""

from __future__ import annotations

import enum
import re
from functools import partial
from typing import Annotated, Any

from gpuswarm.proto.strict import OwnerModel, drop_unknown_keys
from gpuswarm.proto.workloads import WORKLOADS, validate_hyperparameters
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

NODE_ID_PATTERN = r"^[0-9a-f]{16}$"
JOB_ID_PATTERN = r"^j-[0-9a-f]{12}$"

NodeId = Annotated[str, StringConstraints(pattern=NODE_ID_PATTERN)]
JobId = Annotated[str, StringConstraints(pattern=JOB_ID_PATTERN)]
ShortText = Annotated[str, StringConstraints(min_length=1, max_length=128, strip_whitespace=True)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Price = Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=2**53)]
Multiaddr = Annotated[str, StringConstraints(min_length=4, max_length=512, pattern=r"^/")]
Credits = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]


# The header of an artifact upload that carries its signed ArtifactMeta (the body is the raw bytes).
ENVELOPE_HEADER = "X-Gpuswarm-Envelope"
# The artifact the coordinator itself renders from a job's progress history; nodes cannot upload it.
TENSORBOARD_ARTIFACT = "tensorboard.tfevents"


class WireModel(BaseModel):
    """Base for what nodes and the coordinator say to each other: immutable, and unknown fields ignored so that
    mixed versions still talk. (What owners and operators send is strict: `proto.strict.OwnerModel`.)

    Bounds (ranges, lengths, no NaN) are strict; pydantic's lax mode still turns "1.5" into 1.5, which is
    harmless once the value is in range."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class GPUInfo(WireModel):
    model: ShortText
    memory_gb: Annotated[float, Field(gt=0, le=4096, allow_inf_nan=False)]
    count: Annotated[int, Field(ge=1, le=64)] = 1


class Resources(WireModel):
    """What a node offers. A CPU-only node has no GPUs and states its cores and RAM."""

    gpus: list[GPUInfo] = Field(default_factory=list, max_length=16)
    cpu_cores: Annotated[int, Field(ge=1, le=4096)]
    ram_gb: Annotated[float, Field(gt=0, le=65536, allow_inf_nan=False)]

    @property
    def gpu_count(self) -> int:
        return sum(g.count for g in self.gpus)

    @property
    def max_gpu_memory_gb(self) -> float:
        return max((g.memory_gb for g in self.gpus), default=0.0)


WireGuardKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=$")]
Endpoint = Annotated[str, StringConstraints(min_length=3, max_length=64)]  # "host:port" or "[v6]:port"


class MeshRegistration(WireModel):
    """The node's side of the mesh: its WireGuard key and where peers may reach it."""

    public_key: WireGuardKey
    listen_port: Annotated[int, Field(ge=1, le=65535)]
    endpoints: list[Endpoint] = Field(default_factory=list, max_length=16)  # candidates, best first


class NodeRegistration(WireModel):
    """Signed by the node; the coordinator upserts the node under `node_id`."""

    node_id: NodeId
    resources: Resources
    software_version: ShortText
    price_per_gpu_hour: Price = 0.0
    endpoints: list[Annotated[str, StringConstraints(max_length=128)]] = Field(default_factory=list, max_length=16)
    mesh: MeshRegistration | None = None  # None: the node runs without the mesh (--no-mesh)


class MeshPeer(WireModel):
    node_id: NodeId
    public_key: WireGuardKey
    address: Annotated[str, StringConstraints(max_length=64)]  # the peer's mesh address (allowed IP /32)
    endpoints: list[Endpoint] = Field(default_factory=list, max_length=17)  # candidates, best first


class MeshConfig(WireModel):
    """A node's view of the mesh: its own address and every peer it should have, at a version."""

    address: Annotated[str, StringConstraints(max_length=64)]
    cidr: Annotated[str, StringConstraints(max_length=64)]
    version: Annotated[int, Field(ge=0)]
    peers: list[MeshPeer] = Field(default_factory=list, max_length=4096)


class MeshPoll(WireModel):
    """A long-poll for peer changes: answered as soon as the mesh version passes `since`."""

    node_id: NodeId
    since: Annotated[int, Field(ge=-1)] = -1


class NodeState(enum.StrEnum):
    """The daemon's states. Transitions are computed by `gpuswarm.node.states.next_state`."""

    STARTING = "starting"
    REGISTERING = "registering"
    IDLE = "idle"
    TRAINING = "training"
    DISCONNECTED = "disconnected"  # coordinator unreachable; training goes on, reports are buffered
    STOPPING = "stopping"
    OFFLINE = "offline"


class NodeAdvert(WireModel):
    """The signed record a node keeps in the DHT under `NODES_KEY`, subkey = its node id."""

    node_id: NodeId
    state: NodeState
    resources: Resources
    software_version: ShortText
    price_per_gpu_hour: Price = 0.0
    maddrs: list[Multiaddr] = Field(default_factory=list, max_length=16)
    expires_at: NonNegFloat


class Requirements(OwnerModel):
    min_gpu_memory_gb: NonNegFloat = 0.0
    gpu_models: list[ShortText] = Field(default_factory=list, max_length=32)
    allow_cpu: bool = True
    verified_only: bool = False  # only nodes that passed the GPU challenge


class StopRule(OwnerModel):
    """Training stops at whichever comes first. At least one of the two must be set."""

    target_accuracy: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    max_epochs: Annotated[int, Field(ge=1, le=10_000)] | None = 20

    @model_validator(mode="after")
    def _one_rule(self) -> StopRule:
        if self.target_accuracy is None and self.max_epochs is None:
            raise ValueError("a stop rule needs target_accuracy, max_epochs or both")
        return self


class JobSpec(OwnerModel):
    """What a job owner submits (strict: unknown keys and wrong types are errors)."""

    name: Annotated[str, StringConstraints(max_length=128)] = ""
    workload: ShortText
    hyperparameters: dict[str, Any] = Field(default_factory=dict, max_length=64, validate_default=True)
    stop: StopRule = Field(default_factory=StopRule)
    min_nodes: Annotated[int, Field(ge=1, le=1024)] = 1
    max_nodes: Annotated[int, Field(ge=1, le=1024)] = 1
    requirements: Requirements = Field(default_factory=Requirements)
    gpus_per_node: Annotated[int, Field(ge=1, le=64)] = 1  # a CPU node counts as one slot
    max_price_per_gpu_hour: Price | None = None  # the bid: None takes any ask, and ranks below every priced bid
    # Credits reserved from the owner's balance when the job starts; nodes are paid from it, the rest refunded.
    budget: Credits = 0.0

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, value: str) -> str:
        if value not in WORKLOADS:
            raise ValueError(f"unknown workload {value!r}; known: {', '.join(sorted(WORKLOADS))}")
        return value

    @field_validator("hyperparameters")
    @classmethod
    def _workload_hyperparameters(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # Normalise against the workload's own schema, so that a typo fails at submit, not on a node.
        workload = info.data.get("workload")
        return validate_hyperparameters(workload, value) if workload else value

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) is greater than max_nodes ({self.max_nodes})")
        return self


# A job spec as the coordinator relays it to a node in its Assignment: the keys a
# newer coordinator added are dropped rather than refused, so that mixed versions still talk.
RelayedJobSpec = Annotated[JobSpec, BeforeValidator(partial(drop_unknown_keys, JobSpec))]


class JobState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


class AssignmentState(enum.StrEnum):
    ACTIVE = "active"
    FINISHED = "finished"  # the job ended while this node was in it
    FAILED = "failed"  # the node's training process crashed
    LOST = "lost"  # the node stopped heart-beating
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self is not AssignmentState.ACTIVE


class Assignment(WireModel):
    """What the coordinator hands a node: enough to join the job's hivemind run without asking anyone else."""

    assignment_id: Annotated[int, Field(ge=1)]
    job_id: JobId
    node_id: NodeId
    state: AssignmentState
    job_state: JobState
    spec: RelayedJobSpec
    run_id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    shard_index: Annotated[int, Field(ge=0)]
    num_shards: Annotated[int, Field(ge=1)]
    initial_peers: list[Multiaddr] = Field(default_factory=list, max_length=64)


class Progress(WireModel):
    """A node's view of its job's training, sent with each heartbeat."""

    job_id: JobId
    epoch: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    global_step: Count = 0
    samples: Count = 0
    loss: NonNegFloat | None = None
    accuracy: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    samples_per_second: NonNegFloat = 0.0
    peers: Annotated[int, Field(ge=0, le=100_000)] = 0


class AssignmentFailure(WireModel):
    job_id: JobId
    reason: Annotated[str, StringConstraints(max_length=2000)]


class Heartbeat(WireModel):
    node_id: NodeId
    state: NodeState
    progress: list[Progress] = Field(default_factory=list, max_length=16)
    failures: list[AssignmentFailure] = Field(default_factory=list, max_length=16)
    # Measured round-trip times to other nodes over the mesh: the matcher prefers close nodes for a job.
    peer_rtt_ms: dict[NodeId, Annotated[float, Field(ge=0, le=600_000, allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=256)


class AssignmentPoll(WireModel):
    node_id: NodeId


class ContributionClaim(WireModel):
    """What one node did for a job since its previous round, signed by that node (kind `CLAIM_KIND`).

    The training process signs it when an all-reduce round is scheduled and shares it with the round's group
    through the averager's gather metadata, so every member ends up holding the others' signed claims. (job, node,
    epoch) identifies a claim: a node joins at most one round per hivemind epoch."""

    job_id: JobId
    node_id: NodeId
    epoch: Count  # the hivemind epoch this round completes
    samples: Count
    steps: Count
    compute_seconds: Annotated[float, Field(ge=0, le=86_400 * 366, allow_inf_nan=False)]
    window_start: NonNegFloat
    window_end: NonNegFloat
    peer_id: Annotated[str, StringConstraints(max_length=128)] = ""  # the hivemind peer id of the training process

    @model_validator(mode="after")
    def _window(self) -> ContributionClaim:
        if self.window_end < self.window_start:
            raise ValueError("window_end is before window_start")
        return self


CLAIM_KIND = "claim"


class RoundReport(WireModel):
    """A node's report of one round: the signed claims of every member of its group, its own included.

    `solo`: the round found no group (the node stepped alone), so `claims` holds only the node's own claim. The
    coordinator credits a claim when another member of its round reported it too, or when it is solo and no
    other node was in the job at the time."""

    job_id: JobId
    node_id: NodeId
    epoch: Count
    solo: bool = False
    claims: list[dict[str, Any]] = Field(min_length=1, max_length=64)  # SignedEnvelopes of ContributionClaims


class ArtifactMeta(WireModel):
    """Signed header of an artifact upload. The body's SHA-256 binds the signature to the bytes."""

    job_id: JobId
    node_id: NodeId
    # No leading dot: rules out "." and "..", and hidden names that could clash with partial uploads.
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    size: Count
    final: bool = False
    accuracy: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    epoch: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None


class NewOwner(OwnerModel):
    """Admin: create a job owner's account."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.@-]{1,64}$")]
    credits: Credits = 0.0


class CreditAdjustment(OwnerModel):
    """Admin: grant (positive) or withdraw (negative) credits."""

    amount: Annotated[float, Field(ge=-1e12, le=1e12, allow_inf_nan=False)]
    memo: Annotated[str, StringConstraints(max_length=256)] = ""


class RegistrationResponse(WireModel):
    node_id: NodeId
    dht_initial_peers: list[Multiaddr]
    heartbeat_interval: NonNegFloat
    advert_ttl: NonNegFloat
    # None: the node registered without the mesh and uses its configured host address, unencrypted.
    mesh: MeshConfig | None = None


_ID_RE = re.compile(JOB_ID_PATTERN)


def is_job_id(value: str) -> bool:
    return bool(_ID_RE.match(value))
