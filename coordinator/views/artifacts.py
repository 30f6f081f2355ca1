"""Handlers of job artifacts: a member node uploads models and checkpoints, the job's owner downloads them.

Owns PUT and GET /v1/jobs/{job_id}/artifacts/{name} and the files under `artifact_dir/JOB/`. An upload is
authenticated like every node request (`auth.verify_signed` of the signed header, which binds the bytes' size and
SHA-256, and `auth.authenticate_node`), first read-only before the bytes are accepted, then again, recording the
nonce, in the transaction that stores the artifact. A final model completes the job through `jobs.apply`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time

from aiohttp import web
from gpuswarm.coordinator import jobs, tensorboard
from gpuswarm.coordinator.auth import authenticate_node, owned_job, verify_signed
from gpuswarm.coordinator.config import CONFIG, SESSIONS
from gpuswarm.coordinator.db import Artifact
from gpuswarm.coordinator.errors import BadRequest, Forbidden, NotFound, PayloadTooLarge
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.requests import envelope_header
from gpuswarm.coordinator.views import shapes
from gpuswarm.coordinator.views.signals import wake
from gpuswarm.proto import api
from gpuswarm.proto.models import ArtifactMeta
from sqlalchemy import select

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()


@routes.put("/v1/jobs/{job_id}/artifacts/{name}")
@describe(auth="node", body=ArtifactMeta, signed="artifact", response=api.ArtifactStored, status=201)
async def upload_artifact(request: web.Request) -> web.Response:
    """Upload a model or checkpoint; the signed header binds the bytes' size and SHA-256."""
    config = request.app[CONFIG]
    message = verify_signed(envelope_header(request), "artifact", ArtifactMeta)
    meta = message.payload
    if meta.job_id != request.match_info["job_id"] or meta.name != request.match_info["name"]:
        raise BadRequest("the signed job id and name do not match the URL")
    if meta.name == tensorboard.ARTIFACT_NAME:
        raise Forbidden(f"{meta.name} is written by the coordinator from the job's progress; nodes cannot upload it",
                        code="reserved_artifact")
    if meta.size > config.max_artifact_bytes:
        raise PayloadTooLarge(f"artifact is {meta.size} bytes; the limit is {config.max_artifact_bytes}")
    if request.content_length is not None and request.content_length != meta.size:
        raise BadRequest(f"body is {request.content_length} bytes but the signed size is {meta.size}")
    async with request.app[SESSIONS]() as session:  # read-only checks before accepting the bytes
        await authenticate_node(session, message, record_nonce=False)
        job = await jobs.get_job(session, meta.job_id)
        await jobs.require_member(session, job, meta.node_id)

    directory = config.artifact_dir / meta.job_id
    tmp = config.artifact_dir / f".{meta.job_id}.{meta.name}.{secrets.token_hex(4)}.part"
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            async for chunk in request.content.iter_chunked(1 << 20):
                size += len(chunk)
                if size > meta.size:
                    raise BadRequest(f"body is longer than the signed size {meta.size}")
                digest.update(chunk)
                f.write(chunk)
        if size != meta.size or digest.hexdigest() != meta.sha256:
            raise BadRequest("body does not match the signed size and SHA-256", code="digest_mismatch")
        now = time.time()
        async with request.app[SESSIONS].begin() as session:
            await authenticate_node(session, message)  # again: it may have been revoked while the bytes came
            job = await jobs.get_job(session, meta.job_id)
            if meta.final:
                jobs.require(job, jobs.Event.FINAL_MODEL)  # before the file is moved into place
            existing = await session.scalar(select(Artifact).where(Artifact.job_id == job.id,
                                                                   Artifact.name == meta.name))
            if existing is not None:
                await session.delete(existing)
                await session.flush()
            session.add(Artifact(job_id=job.id, name=meta.name, node_id=meta.node_id, sha256=meta.sha256,
                                 size=meta.size, final=meta.final, accuracy=meta.accuracy, created_at=now))
            directory.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, directory / meta.name)
            if meta.final:
                job.final_accuracy = meta.accuracy
                if meta.accuracy is not None:
                    job.accuracy = meta.accuracy
                await jobs.apply(session, job, jobs.Event.FINAL_MODEL, now,
                                 f"completed: node {meta.node_id} saved the final model (accuracy {meta.accuracy})")
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("artifact %s/%s stored (%d bytes%s)", meta.job_id, meta.name, size, ", final" if meta.final else "")
    wake(request)
    return respond(api.ArtifactStored, shapes.artifact_stored_json(meta.name, size, meta.sha256), status=201)


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
    path = request.app[CONFIG].artifact_dir / job.id / artifact.name
    return web.FileResponse(path, headers={"X-Content-SHA256": artifact.sha256,
                                           "Content-Disposition": f'attachment; filename="{artifact.name}"'})
