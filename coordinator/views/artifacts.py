"""Handlers of job artifacts: a member node uploads models and checkpoints, the job's owner lists and downloads them.

Owns PUT and GET /v1/jobs/{job_id}/artifacts/{name} and GET /v1/jobs/{job_id}/artifacts. An artifact is a name in
a job (`db.Artifact`) for a blob in the content-addressed store (`coordinator.store`, docs/decisions/0013): its
bytes are stored once, under their SHA-256. An upload is authenticated like every node request
(`auth.verify_signed` of the signed header, which binds the bytes' size and SHA-256, and `auth.authenticate_node`),
first read-only before the bytes are accepted, then again, recording the nonce, in the transaction that stores the
artifact. An upload with `checkpoint_step` is a checkpoint: the job keeps its newest `training.checkpoints_kept`.
A final model completes the job through `jobs.apply`, its metrics becoming the job's `final_metrics`.
"""

from __future__ import annotations

import hashlib
import logging
import time

from aiohttp import web
from gpuswarm.coordinator import blobs, jobs, tensorboard
from gpuswarm.coordinator.auth import authenticate_node, owned_job, verify_signed
from gpuswarm.coordinator.config import BLOB_LOCK, CONFIG, SESSIONS
from gpuswarm.coordinator.db import Artifact
from gpuswarm.coordinator.errors import BadRequest, Forbidden, NotFound, PayloadTooLarge
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.requests import envelope_header
from gpuswarm.coordinator.views import shapes
from gpuswarm.coordinator.views.blobs import receive, serve_blob
from gpuswarm.coordinator.views.signals import wake
from gpuswarm.proto import api
from gpuswarm.proto.models import ArtifactMeta, JobSpec
from sqlalchemy import select

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()


@routes.put("/v1/jobs/{job_id}/artifacts/{name}")
@describe(auth="node", body=ArtifactMeta, signed="artifact", response=api.ArtifactStored, status=201)
async def upload_artifact(request: web.Request) -> web.Response:
    """Upload a model or checkpoint; the signed header binds the bytes' size and SHA-256. With `checkpoint_step`
    it is a checkpoint of that global step, and only the job's newest `training.checkpoints_kept` are kept."""
    config = request.app[CONFIG]
    message = verify_signed(envelope_header(request), "artifact", ArtifactMeta)
    meta = message.payload
    if meta.job_id != request.match_info["job_id"] or meta.name != request.match_info["name"]:
        raise BadRequest("the signed job id and name do not match the URL")
    if meta.name == tensorboard.ARTIFACT_NAME:
        raise Forbidden(f"{meta.name} is written by the coordinator from the job's progress; nodes cannot upload it",
                        code="reserved_artifact")
    if meta.final and meta.checkpoint_step is not None:
        raise BadRequest("an artifact is either the final model or a checkpoint, not both")
    if meta.size > config.max_artifact_bytes:
        raise PayloadTooLarge(f"artifact is {meta.size} bytes; the limit is {config.max_artifact_bytes}")
    if request.content_length is not None and request.content_length != meta.size:
        raise BadRequest(f"body is {request.content_length} bytes but the signed size is {meta.size}")
    async with request.app[SESSIONS]() as session:  # read-only checks before accepting the bytes
        await authenticate_node(session, message, record_nonce=False)
        job = await jobs.get_job(session, meta.job_id)
        await jobs.require_member(session, job, meta.node_id)

    staged = await receive(request, meta.sha256, meta.size)
    pruned: list[str] = []
    try:
        async with request.app[BLOB_LOCK]:  # the blob's bytes and row appear together (retention takes it too)
            now = time.time()
            async with request.app[SESSIONS].begin() as session:
                await authenticate_node(session, message)  # again: it may have been revoked while the bytes came
                job = await jobs.get_job(session, meta.job_id)
                if meta.final:
                    jobs.require(job, jobs.Event.FINAL_MODEL)  # before the bytes are committed
                existing = await session.scalar(select(Artifact).where(Artifact.job_id == job.id,
                                                                       Artifact.name == meta.name))
                if existing is not None:
                    await session.delete(existing)
                    await session.flush()
                await staged.commit()
                await blobs.record_blob(session, meta.sha256, meta.size, now)
                session.add(Artifact(job_id=job.id, name=meta.name, node_id=meta.node_id, sha256=meta.sha256,
                                     size=meta.size, final=meta.final, accuracy=meta.accuracy, created_at=now,
                                     checkpoint_step=meta.checkpoint_step,
                                     metrics=dict(meta.metrics) if meta.metrics is not None else None))
                if meta.checkpoint_step is not None:
                    await session.flush()
                    kept = JobSpec.model_validate(job.spec).training.checkpoints_kept
                    pruned = await blobs.prune_checkpoints(session, job.id, kept)
                if meta.final:
                    job.final_accuracy = meta.accuracy
                    if meta.accuracy is not None:
                        job.accuracy = meta.accuracy
                    if meta.metrics is not None:
                        job.final_metrics = dict(meta.metrics)
                    await jobs.apply(session, job, jobs.Event.FINAL_MODEL, now,
                                     f"completed: node {meta.node_id} saved the final model ("
                                     + (_metrics_text(meta.metrics) if meta.metrics else f"accuracy {meta.accuracy}")
                                     + ")")
    finally:
        await staged.discard()
    kind = ", final" if meta.final else (
        f", checkpoint of step {meta.checkpoint_step}" if meta.checkpoint_step is not None else "")
    logger.info("artifact %s/%s stored (%d bytes%s)%s", meta.job_id, meta.name, meta.size, kind,
                f"; older checkpoints dropped: {', '.join(pruned)}" if pruned else "")
    wake(request)
    return respond(api.ArtifactStored, shapes.artifact_stored_json(meta.name, meta.size, meta.sha256), status=201)


def _metrics_text(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(metrics.items()))


@routes.get("/v1/jobs/{job_id}/artifacts")
@describe(auth="owner", response=api.ArtifactList)
async def list_artifacts(request: web.Request) -> web.Response:
    """The job's artifacts (models, checkpoints with their step, the TensorBoard file), oldest first."""
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        rows = (await session.scalars(select(Artifact).where(Artifact.job_id == job.id)
                                      .order_by(Artifact.created_at, Artifact.id))).all()
    return respond(api.ArtifactList, shapes.artifact_list_json(job, rows))


@routes.get("/v1/jobs/{job_id}/artifacts/{name}")
@describe(auth="owner")
async def download_artifact(request: web.Request) -> web.StreamResponse:
    """Download an artifact (header X-Content-SHA256). tensorboard.tfevents: the job's progress as a TensorBoard
    event file, stored when the job settles and rendered from the progress points until then."""
    name = request.match_info["name"]
    points = None
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        artifact = await session.scalar(select(Artifact).where(Artifact.job_id == job.id, Artifact.name == name))
        if artifact is None and name == tensorboard.ARTIFACT_NAME:
            points = await tensorboard.load_points(session, job.id)
    if points is not None:
        data = await tensorboard.render(points, time.time())
        return web.Response(body=data, content_type="application/octet-stream", headers={
            "X-Content-SHA256": hashlib.sha256(data).hexdigest(),
            "Content-Disposition": f'attachment; filename="{name}"'})
    if artifact is None:
        raise NotFound(f"job {job.id} has no artifact {name!r}", code="unknown_artifact")
    return await serve_blob(request, artifact.sha256, filename=artifact.name)
