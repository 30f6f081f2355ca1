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
import json
import re
from functools import partial
from typing import Annotated, Any, Literal

from gpuswarm.proto.signing import SignedEnvelope
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
MAX_PARAMS_JSON = 16 * 1024
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# A dataset's name: a packed dataset's file or directory name, or a node-local dataset's name (federated jobs).
DatasetName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")]
# `package.module:function`: where the node finds a job owner's workload factory (see gpuswarm.sdk).
ENTRYPOINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
# A stop rule on a metric: "val_bpb <= 2.2", "accuracy >= 0.95".
TARGET_PATTERN = r"^\s*([A-Za-z_][A-Za-z0-9_./-]{0,63})\s*(<=|>=)\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$"
MetricName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_./-]{0,63}$")]
Metrics = dict[MetricName, Annotated[float, Field(allow_inf_nan=False)]]


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
    """What a node offers. A CPU-only node has no GPUs and states its cores and RAM. `custom_code`: its operator
    opted in to running job owners' own code (`node start --allow-custom-code`); built-in workloads run anywhere.
    `datasets`: the names of the datasets its operator keeps on it for federated jobs (`JobSpec.local_dataset`)."""

    gpus: list[GPUInfo] = Field(default_factory=list, max_length=16)
    cpu_cores: Annotated[int, Field(ge=1, le=4096)]
    ram_gb: Annotated[float, Field(gt=0, le=65536, allow_inf_nan=False)]
    custom_code: bool = False
    datasets: list[DatasetName] = Field(default_factory=list, max_length=64)

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
    via: NodeId | None = None  # the peer to route through: no direct path between this node and this peer


class MeshConfig(WireModel):
    """A node's view of the mesh: its own address and every peer it should have, at a version."""

    address: Annotated[str, StringConstraints(max_length=64)]
    cidr: Annotated[str, StringConstraints(max_length=64)]
    version: Annotated[int, Field(ge=0)]
    peers: list[MeshPeer] = Field(default_factory=list, max_length=4096)
    forward: bool = False  # this node relays for peers that have no direct path between them


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
    """Training stops at whichever rule is met first; at least one must be set.

    `target` is a rule on any metric the workload's `evaluate` reports, "NAME <= X" or "NAME >= X" (for example
    "val_bpb <= 2.2"); `target_accuracy = X` is short for "accuracy >= X". `max_epochs` counts passes over the
    training data and applies to workloads that know their size; `max_steps` counts global (averaged) steps and
    `max_seconds` the wall time since the node's training process started training (a resume starts it again)."""

    target: Annotated[str, StringConstraints(pattern=TARGET_PATTERN)] | None = None
    target_accuracy: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    max_epochs: Annotated[int, Field(ge=1, le=10_000)] | None = 20
    max_steps: Annotated[int, Field(ge=1, le=10**9)] | None = None
    max_seconds: Annotated[float, Field(gt=0, le=366 * 86_400, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _one_rule(self) -> StopRule:
        if all(v is None for v in (self.target, self.target_accuracy, self.max_epochs, self.max_steps,
                                   self.max_seconds)):
            raise ValueError("a stop rule needs target, target_accuracy, max_epochs, max_steps or max_seconds")
        return self

    def metric_targets(self) -> list[tuple[str, str, float]]:
        """The rules on metrics as (name, "<=" or ">=", threshold)."""
        rules = []
        if self.target is not None:
            name, op, value = re.match(TARGET_PATTERN, self.target).groups()
            rules.append((name, op, float(value)))
        if self.target_accuracy is not None:
            rules.append(("accuracy", ">=", self.target_accuracy))
        return rules


class BlobRef(OwnerModel):
    """Bytes in the coordinator's content-addressed store, named by their SHA-256."""

    sha256: Sha256
    size: Count


class CodeRef(BlobRef):
    """A job owner's training code: a directory packed as a tar, or a wheel, and the factory to call in it."""

    format: Literal["tar", "wheel"]
    entrypoint: Annotated[str, StringConstraints(pattern=ENTRYPOINT_PATTERN, max_length=200)]


class DatasetRef(BlobRef):
    """A job's dataset: one file (`name` is its file name) or a directory packed as a tar (`name` is the
    directory's name); the node hands the workload the file or the unpacked directory."""

    format: Literal["file", "tar"]
    name: DatasetName


class TrainingOptions(OwnerModel):
    """How nodes train the job, whatever the workload. `precision = "bf16"` runs the forward pass and the loss
    under bfloat16 autocast where the device supports it (fp32 elsewhere, said in the job's log). A checkpoint
    (model, optimizer state, step, data position) is uploaded every `checkpoint_every_steps` global steps or
    `checkpoint_every_minutes`, whichever comes first; the newest `checkpoints_kept` are kept.

    `mode` is how nodes combine their work. "diloco" (the default; measured in docs/benchmarks.md): every node takes
    `inner_steps` steps of the workload's own optimizer on its own batches, then the nodes average how far their
    parameters moved (the pseudo-gradient) and an outer SGD applies it (`outer_learning_rate`, and Nesterov momentum
    when `outer_momentum` > 0); one averaged outer step is one global step. The defaults (rate 1, no momentum: the
    swarm moves to the average of its members' parameters) measured best on tinylm at tens of inner steps, and a
    lone node then trains exactly as one process would; DiLoCo's published 0.7 and 0.9 are for hundreds. Left
    unset, `inner_steps` is chosen by each node from the step and round times it measures, so that averaging takes
    about a quarter of a round, and, in a job that may have several nodes, at most 8 passes over a node's share of
    the data (`train_size` / `max_nodes`, when the workload gives its `train_size`).
    "sync": one averaged gradient step per `target_batch_size` samples across the swarm
    (plain data parallel, as one machine with that batch would train). "fedavg" (federated averaging, for a job on
    node-local data, `JobSpec.local_dataset`): every node trains `local_epochs` passes over its own data (or
    `inner_steps` steps), then the swarm takes the members' parameters averaged, weighted by the samples each
    trained (the outer step at rate 1, no momentum).

    `compression` is what averaging rounds send: "8bit" (a quarter of fp32's bytes; tensors under 65,536 values go
    as fp16), "fp16" (half) or "none". Left out, it is "8bit" in the local-update modes, which average a
    pseudo-gradient once a round (over the lab's WAN their rounds took a quarter less time in 8 bits than in fp16:
    decision 0037), and "fp16" in "sync", which averages every step's gradients."""

    precision: Literal["fp32", "bf16"] = "fp32"
    mode: Literal["diloco", "sync", "fedavg"] = "diloco"
    inner_steps: Annotated[int, Field(ge=1, le=100_000)] | None = None
    local_epochs: Annotated[int, Field(ge=1, le=1000)] | None = None  # "fedavg" only: passes a round (default 1)
    outer_learning_rate: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] = 1.0
    outer_momentum: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    compression: Literal["none", "fp16", "8bit"] = "8bit"  # "fp16" in mode "sync" (see _compression_by_mode)
    checkpoint_every_steps: Annotated[int, Field(ge=1, le=10**9)] | None = None
    checkpoint_every_minutes: Annotated[float, Field(gt=0, le=7 * 24 * 60, allow_inf_nan=False)] | None = 10.0
    checkpoints_kept: Annotated[int, Field(ge=1, le=100)] = 3

    @model_validator(mode="before")
    @classmethod
    def _compression_by_mode(cls, data: Any) -> Any:
        """A sync job that names no compression averages in fp16: 8-bit rounding of every step's gradients is a
        risk that nothing measured here pays for."""
        if isinstance(data, dict) and "compression" not in data and data.get("mode") == "sync":
            return {**data, "compression": "fp16"}
        return data


class JobSpec(OwnerModel):
    """What a job owner submits (strict: unknown keys and wrong types are errors).

    Either `workload` names a built-in workload (its hyper-parameters are checked here against its schema), or
    `code` refers to the owner's own code in the artifact store (its params are checked by `gpuswarm job submit`
    against the code's own schema, and again on the node). `dataset`, if any, is handed to the workload."""

    name: Annotated[str, StringConstraints(max_length=128)] = ""
    workload: ShortText | None = None
    code: CodeRef | None = None
    dataset: DatasetRef | None = None
    # Federated: a dataset each node keeps itself, by the name its operator gave it (node setting `datasets`); only
    # nodes that hold it are matched, and its data never leave them.
    local_dataset: DatasetName | None = None
    hyperparameters: dict[str, Any] = Field(default_factory=dict, max_length=64, validate_default=True)
    stop: StopRule = Field(default_factory=StopRule)
    training: TrainingOptions = Field(default_factory=TrainingOptions)
    min_nodes: Annotated[int, Field(ge=1, le=1024)] = 1
    max_nodes: Annotated[int, Field(ge=1, le=1024)] = 1
    requirements: Requirements = Field(default_factory=Requirements)
    gpus_per_node: Annotated[int, Field(ge=1, le=64)] = 1  # a CPU node counts as one slot
    max_price_per_gpu_hour: Price | None = None  # the bid: None takes any ask, and ranks below every priced bid
    # Credits reserved from the owner's balance when the job starts; nodes are paid from it, the rest refunded.
    budget: Credits = 0.0

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, value: str | None) -> str | None:
        if value is not None and value not in WORKLOADS:
            raise ValueError(f"unknown workload {value!r}; known: {', '.join(sorted(WORKLOADS))}")
        return value

    @field_validator("hyperparameters")
    @classmethod
    def _workload_hyperparameters(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # Normalise against the workload's own schema, so that a typo fails at submit, not on a node. The params of
        # owners' code are checked against that code's schema by the CLI and the node (the coordinator never
        # imports owners' code), so here they only need to be JSON of bounded size.
        workload = info.data.get("workload")
        if workload:
            return validate_hyperparameters(workload, value)
        if len(json.dumps(value, allow_nan=False)) > MAX_PARAMS_JSON:
            raise ValueError(f"params are over {MAX_PARAMS_JSON} bytes as JSON")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if (self.workload is None) == (self.code is None):
            raise ValueError("a job names either a built-in workload or its own code, not both and not neither")
        if self.workload is not None and self.dataset is not None:
            raise ValueError(f"workload {self.workload} brings its own data; remove dataset")
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) is greater than max_nodes ({self.max_nodes})")
        if self.local_dataset is not None and (self.code is None or self.dataset is not None):
            raise ValueError("local_dataset (the nodes' own data) goes with the job's own code and no dataset")
        if self.training.mode == "fedavg" and self.local_dataset is None:
            raise ValueError('training mode "fedavg" is for node-local data: name it in local_dataset')
        if self.training.local_epochs is not None and self.training.mode != "fedavg":
            raise ValueError('local_epochs is for training mode "fedavg"')
        return self

    @property
    def custom_code(self) -> bool:
        """The job runs its owner's code: only nodes whose operator opted in may take it."""
        return self.code is not None

    @property
    def label(self) -> str:
        """What the job runs, in one word: the built-in workload's name or the owner's entrypoint."""
        return self.workload or (self.code.entrypoint if self.code else "?")

    def blob_refs(self) -> list[BlobRef]:
        """The artifacts the job refers to (its nodes may read them; the store keeps them while the job exists)."""
        return [ref for ref in (self.code, self.dataset) if ref is not None]


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
    BANNED = "banned"  # members of its rounds named it a Byzantine outlier (see RoundReport.suspects)

    @property
    def is_final(self) -> bool:
        return self is not AssignmentState.ACTIVE


class CheckpointRef(WireModel):
    """A checkpoint among a job's artifacts: its name, bytes and the global step it holds."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")]
    sha256: Sha256
    size: Count
    step: Count


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
    # The job's newest checkpoint when this answer was made: nodes that find no peer with the job's state resume
    # from it instead of from step 0.
    checkpoint: CheckpointRef | None = None
    # The coordinator's DHT cert for this node in this run (gpuswarm.proto.dht): what lets its training process
    # write the run's records. Fresh in every answer; none once the assignment has ended.
    ticket: SignedEnvelope | None = None


# Global steps a progress report may run ahead of the epochs its job's claims reached (the coordinator's ceiling on a
# job's step; a node reports only progress within it, coordinator/heartbeats.py and node/daemon.py).
PROGRESS_MARGIN = 5


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
    metrics: Metrics = Field(default_factory=dict, max_length=32)  # everything the workload's evaluate reported


class AssignmentFailure(WireModel):
    job_id: JobId
    reason: Annotated[str, StringConstraints(max_length=2000)]


MAX_HEARTBEAT_PROGRESS = 16  # jobs' progress one heartbeat carries


class Heartbeat(WireModel):
    node_id: NodeId
    state: NodeState
    progress: list[Progress] = Field(default_factory=list, max_length=MAX_HEARTBEAT_PROGRESS)
    failures: list[AssignmentFailure] = Field(default_factory=list, max_length=16)
    # Measured round-trip times to other nodes over the mesh: the matcher prefers close nodes for a job.
    peer_rtt_ms: dict[NodeId, Annotated[float, Field(ge=0, le=600_000, allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=256)
    # Peers this node has had no working mesh path to for a while: the coordinator finds them a relay.
    unreachable_peers: list[NodeId] = Field(default_factory=list, max_length=256)


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
    # hivemind peer ids whose parts this node's reducer clipped as outliers since its previous report: the
    # coordinator attests nothing of theirs from this report, and bans a peer that two members name.
    suspects: list[Annotated[str, StringConstraints(min_length=1, max_length=128)]] = Field(
        default_factory=list, max_length=16)


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
    checkpoint_step: Count | None = None  # set: the artifact is a checkpoint of this global step
    metrics: Metrics | None = Field(default=None, max_length=32)  # a final model's metrics


class BlobFetch(WireModel):
    """Signed by a node to read an artifact of a job it is assigned to (code, dataset or checkpoint)."""

    job_id: JobId
    node_id: NodeId
    sha256: Sha256


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
    authority: str | None = None  # the key the swarm's DHT records chain to (gpuswarm.proto.dht)
    certificate: SignedEnvelope | None = None  # the DHT cert for this node's advert


_ID_RE = re.compile(JOB_ID_PATTERN)


def is_job_id(value: str) -> bool:
    return bool(_ID_RE.match(value))
