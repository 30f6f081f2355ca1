"""Wire models of refereed re-execution: the coordinator audits a sampled round of a node, a third node re-computes
it from the node's evidence, and the verdict decides whether the node keeps what the job paid it.

Flow (docs/security.md, decision 0030): the coordinator draws credited claims of jobs in mode "diloco" or
"fedavg" (`AuditRequest`, in the node's assignment poll); the node uploads that round's evidence (the signed
header `EvidenceMeta`, kind "evidence"); a referee, a node that was not in the round, gets a `RefereeTask` in its
poll, fetches the job's code and data and the evidence (`EvidenceFetch`, kind "fetch_evidence"), re-computes the
round and posts its signed `AuditVerdict` (kind "verdict"). `AuditInfo` is what owners and operators read.
"""

from __future__ import annotations

from typing import Annotated, Literal

from gpuswarm.proto.models import Count, JobId, NodeId, RelayedJobSpec, Sha256, WireModel
from pydantic import Field, StringConstraints

AUDIT_ID_PATTERN = r"^a-[0-9a-f]{12}$"
AuditId = Annotated[str, StringConstraints(pattern=AUDIT_ID_PATTERN)]
EVIDENCE_KIND = "evidence"
FETCH_EVIDENCE_KIND = "fetch_evidence"
VERDICT_KIND = "verdict"
AuditState = Literal["requested", "waiting", "assigned", "passed", "failed", "unanswered", "void"]


class AuditRequest(WireModel):
    """The coordinator asks this node for the evidence of its round of `epoch` in a job."""

    audit_id: AuditId
    job_id: JobId
    epoch: Count


class RefereeTask(WireModel):
    """Re-compute node `node_id`'s round of `epoch` in job `job_id` from its evidence. The referee may fetch the
    job's code and dataset while the task is its own."""

    audit_id: AuditId
    job_id: JobId
    node_id: NodeId
    epoch: Count
    spec: RelayedJobSpec
    evidence_sha256: Sha256
    evidence_size: Count


class EvidenceMeta(WireModel):
    """Signed header of an evidence upload (PUT /v1/audits/{audit_id}/evidence); the body is the file."""

    audit_id: AuditId
    node_id: NodeId
    sha256: Sha256
    size: Count


class EvidenceFetch(WireModel):
    """Signed header of a referee's evidence download (GET /v1/audits/{audit_id}/evidence)."""

    audit_id: AuditId
    node_id: NodeId


class AuditVerdict(WireModel):
    """A referee's verdict on one round (POST /v1/audits/{audit_id}/verdict), signed by the referee `node_id`.
    `distance`: how far the node's kept end lies from the re-computed one, as a share of the round's movement
    (None when the evidence could not be replayed at all)."""

    audit_id: AuditId
    node_id: NodeId
    steps: Count
    samples: Count
    distance: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    passed: bool
    reason: Annotated[str, StringConstraints(max_length=500)] = ""


class AuditInfo(WireModel):
    """One audit, as GET /v1/jobs/{job_id}/audits lists it."""

    audit_id: AuditId
    node_id: NodeId
    epoch: Count
    state: AuditState
    referees: list[NodeId] = Field(default_factory=list, max_length=16)  # who answered, in order
    distance: float | None = None
    reason: str = ""
    requested_at: float
