"""The JSON shapes of the /v1 API's responses: every dict a handler answers with is built here.

Owns the field names and nesting clients see (jobs, nodes, owners, assignments, artifacts, round results).
Pure functions of rows and values already loaded: no queries, no requests. The ledger's statements
(`ledger.job_statement`, `ledger.node_statement`, `ledger.contributions`) and the challenge routes' answers
(`challenge.challenge_json`, proto models) are built where their queries are.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence

from gpuswarm.coordinator import ledger, tensorboard
from gpuswarm.coordinator.authority import Authority
from gpuswarm.coordinator.db import Artifact, AssignmentRow, Audit, Contribution, Job, JobEvent, Node, Owner
from gpuswarm.coordinator.ledger import Ignored
from gpuswarm.proto.dht import job_run_id
from gpuswarm.proto.models import Assignment, AssignmentState, CheckpointRef, JobSpec, JobState

from gpuswarm import __version__


def health_json(leader: bool) -> dict:
    return {"ok": True, "version": __version__, "time": time.time(), "leader": leader}


def job_json(job: Job) -> dict:
    return {
        "id": job.id, "name": job.name, "state": job.state, "spec": job.spec,
        "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
        "progress": {"epoch": job.epoch, "global_step": job.global_step, "accuracy": job.accuracy, "loss": job.loss,
                     "samples_per_second": job.samples_per_second, "peers": job.peers, "metrics": job.metrics or {}},
        "final_accuracy": job.final_accuracy, "final_metrics": job.final_metrics, "error": job.error,
        "owner_id": job.owner_id,
        "dht_epoch": job.dht_epoch,
    }


def job_list_json(jobs: Iterable[Job], active_nodes: dict[str, int]) -> dict:
    return {"jobs": [job_json(j) | {"active_nodes": active_nodes.get(j.id, 0)} for j in jobs]}


def job_detail_json(job: Job, assignments: Sequence[AssignmentRow], artifacts: Sequence[Artifact],
                    contributions: list[dict], events: Sequence[JobEvent]) -> dict:
    """A job with its assignments, artifacts, contributions and events (`events` newest first, as queried)."""
    return job_json(job) | {
        "assignments": [{"node_id": a.node_id, "state": a.state, "shard_index": a.shard_index, "gpus": a.gpus,
                         "price_per_gpu_hour": a.price_per_gpu_hour, "created_at": a.created_at,
                         "ended_at": a.ended_at, "reason": a.reason} for a in assignments],
        "artifacts": [artifact_json(a) for a in artifacts],
        "contributions": contributions,
        "events": [{"at": e.at, "message": e.message} for e in reversed(events)],
    }


def artifact_json(a: Artifact) -> dict:
    return {"name": a.name, "size": a.size, "sha256": a.sha256, "final": a.final, "accuracy": a.accuracy,
            "node_id": a.node_id, "created_at": a.created_at, "checkpoint_step": a.checkpoint_step,
            "metrics": a.metrics}


def artifact_list_json(job: Job, artifacts: Iterable[Artifact]) -> dict:
    return {"job_id": job.id, "artifacts": [artifact_json(a) for a in artifacts]}


def contributions_json(job: Job, contributions: list[dict]) -> dict:
    return {"job_id": job.id, "contributions": contributions}


def progress_json(job: Job, points: Iterable[tensorboard.Point], truncated: bool) -> dict:
    return {"job_id": job.id, "state": job.state, "points": [dataclasses.asdict(p) for p in points],
            "truncated": truncated}


def node_json(node: Node, adverts: dict) -> dict:
    advert = adverts.get(node.id)
    return {
        "id": node.id, "state": node.state, "online": node.online, "resources": node.resources,
        "software_version": node.software_version, "price_per_gpu_hour": node.price_per_gpu_hour,
        "endpoints": node.endpoints, "registered_at": node.registered_at, "last_seen": node.last_seen,
        "revoked": node.revoked, "mesh_address": node.mesh_address, "mesh_endpoints": node.mesh_endpoints,
        "verified": bool(node.verified), "measured_gflops": node.measured_gflops,
        "online_seconds": round(node.online_seconds, 1),
        "advert": None if advert is None else {"state": advert["state"], "expires_at": advert["dht_expiry"],
                                                "maddrs": advert["maddrs"]},
    }


def node_list_json(nodes: Iterable[Node], adverts: dict, jobs: dict[str, list[str]],
                   reputations: dict[str, float]) -> dict:
    return {"nodes": [node_json(n, adverts) | {"job_id": (jobs.get(n.id) or [None])[0], "job_ids": jobs.get(n.id, []),
                                               "reputation": reputations[n.id]} for n in nodes]}


def revoked_json(node_id: str) -> dict:
    return {"ok": True, "node_id": node_id, "revoked": True}


def assignments_json(rows: Iterable[tuple[AssignmentRow, Job]], initial_peers: list[str],
                     checkpoints: Mapping[str, CheckpointRef], authority: Authority) -> dict:
    """A node's active assignments, each with its job, the job's newest checkpoint and a fresh run ticket, as
    proto `Assignment`s."""
    return {"assignments": [
        Assignment(assignment_id=a.id, job_id=j.id, node_id=a.node_id, state=AssignmentState(a.state),
                   job_state=JobState(j.state), spec=JobSpec.model_validate(j.spec), run_id=job_run_id(j.id),
                   shard_index=a.shard_index, num_shards=a.num_shards, initial_peers=initial_peers,
                   checkpoint=checkpoints.get(j.id), ticket=authority.run_ticket(a.node_id, job_run_id(j.id)),
                   ).model_dump(mode="json")
        for a, j in rows]}


def dht_json(initial_peers: list[str], authority: str) -> dict:
    return {"initial_peers": initial_peers, "authority": authority}


def round_json(results: Sequence[Contribution], ignored: Sequence[Ignored]) -> dict:
    return {"ok": True,
            "claims": [{"node_id": r.node_id, "epoch": r.epoch, "status": r.status,
                        "credited_samples": r.credited_samples, "flag": r.flag} for r in results],
            "ignored": [{"node_id": i.node_id, "epoch": i.epoch, "reason": i.reason} for i in ignored]}


def audit_answer_json(audit: Audit) -> dict:
    return {"ok": True, "audit_id": audit.id, "state": audit.state}


def audit_list_json(job: Job, rows: Sequence[Audit]) -> dict:
    return {"job_id": job.id, "audits": [
        {"audit_id": a.id, "node_id": a.node_id, "epoch": a.epoch, "state": a.state, "referees": list(a.referees),
         "distance": a.distance, "reason": a.reason, "requested_at": a.requested_at} for a in rows]}


def artifact_stored_json(name: str, size: int, sha256: str) -> dict:
    return {"ok": True, "name": name, "size": size, "sha256": sha256}


def owner_json(owner: Owner, balance: int) -> dict:
    """`balance`: micro-credits, as `ledger.balance` counts them."""
    return {"id": owner.id, "name": owner.name, "created_at": owner.created_at, "balance": ledger.credits(balance)}


def new_owner_json(owner: Owner, token: str, credits: float) -> dict:
    """The new owner's token appears in this response only."""
    return {"id": owner.id, "name": owner.name, "token": token, "balance": credits}
