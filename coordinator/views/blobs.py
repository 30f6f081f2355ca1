"""Handlers of the content-addressed store's routes: what an owner holds, owner uploads and reads, node reads.

Owns POST /v1/blobs/missing, PUT and GET /v1/blobs/{sha256} (job owners, bearer token) and
GET /v1/jobs/{job_id}/blobs/{sha256} (nodes, a signed `fetch` header). Every answer about blobs is relative to the
calling owner: an owner holds a blob only once it uploaded the bytes itself, so no owner learns what another
uploaded (docs/decisions/0013). The rules are `coordinator.blobs`', the bytes `coordinator.store`'s; `serve_blob`
is shared with the artifact downloads.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated

from aiohttp import web
from gpuswarm.coordinator import blobs, jobs
from gpuswarm.coordinator.auth import authenticate_node, current_owner, owner_of, verify_signed
from gpuswarm.coordinator.config import BLOB_LOCK, BLOBS, CONFIG, SESSIONS
from gpuswarm.coordinator.db import BlobHolder
from gpuswarm.coordinator.errors import BadRequest, Forbidden, LengthRequired, NotFound, PayloadTooLarge
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.requests import envelope_header, parse, read_json
from gpuswarm.coordinator.store import CHUNK, SHA256_RE, BlobStore, DigestMismatch, SizeMismatch, StagedBlob
from gpuswarm.proto import api
from gpuswarm.proto.models import BlobFetch, Sha256
from gpuswarm.proto.strict import OwnerModel
from pydantic import Field

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()
MAX_QUERY = 64
GIB = 1024**3


class BlobQuery(OwnerModel):
    """POST /v1/blobs/missing: the digests to ask about (at most 64)."""

    sha256: Annotated[list[Sha256], Field(min_length=1, max_length=MAX_QUERY)]


def digest_in_path(request: web.Request) -> str:
    sha256 = request.match_info["sha256"]
    if not SHA256_RE.fullmatch(sha256):
        raise BadRequest(f"{sha256[:80]!r} is not a SHA-256 in lowercase hex (64 digits)", code="bad_digest")
    return sha256


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1024**2:.1f} MiB"


async def receive(request: web.Request, sha256: str, size: int) -> StagedBlob:
    """The request's body, streamed into the store's staging and checked against `sha256` and `size` (400
    `digest_mismatch` / `size_mismatch`). The caller commits it under BLOB_LOCK, with its row."""
    try:
        return await request.app[BLOBS].stage(sha256, size, request.content.iter_chunked(CHUNK))
    except DigestMismatch as e:
        raise BadRequest(f"the bytes do not match their SHA-256: {e}", code="digest_mismatch") from None
    except SizeMismatch as e:
        raise BadRequest(str(e), code="size_mismatch") from None


async def serve_blob(request: web.Request, sha256: str, filename: str | None = None) -> web.StreamResponse:
    """The blob's bytes, with X-Content-SHA256 (the client checks it); 404 `blob_missing` if the store lost them."""
    store: BlobStore = request.app[BLOBS]
    headers = {"X-Content-SHA256": sha256}
    if filename is not None:
        headers["Content-Disposition"] = f'attachment; filename="{filename}"'
    path = store.local_path(sha256)
    if path is not None:
        return web.FileResponse(path, headers=headers)
    if not await store.exists(sha256):
        raise NotFound(f"the bytes of {sha256[:12]}… are missing from the store", code="blob_missing")
    response = web.StreamResponse(headers=headers | {"Content-Type": "application/octet-stream"})
    await response.prepare(request)
    async for chunk in store.read(sha256):
        await response.write(chunk)
    await response.write_eof()
    return response


@routes.post("/v1/blobs/missing")
@describe(auth="owner", body=BlobQuery, response=api.BlobsMissing)
async def missing_blobs(request: web.Request) -> web.Response:
    """Which of up to 64 digests the calling owner does not hold (has not uploaded itself), in the order asked."""
    owner = await owner_of(request)
    query = parse(BlobQuery, await read_json(request), "blob query")
    async with request.app[SESSIONS].begin() as session:
        held = await blobs.holdings(session, owner.id, query.sha256)
        # Used now: the retention pass leaves them for a while, so a submit that skips their upload finds them.
        await blobs.touch(session, list(held), time.time())
    return respond(api.BlobsMissing, {"missing": [s for s in dict.fromkeys(query.sha256) if s not in held]})


async def check_quota(session, owner_id: str, sha256: str, size: int, quota: int) -> tuple[int, bool]:
    """(bytes the owner holds, whether it holds `sha256` already); 403 `quota_exceeded` if this blob would pass
    the quota."""
    used = await blobs.held_bytes(session, owner_id)
    already = sha256 in await blobs.holdings(session, owner_id, [sha256])
    if not already and used + size > quota:
        raise Forbidden(f"over your storage quota: you hold {used} bytes ({_size(used)}) of {quota} "
                        f"({_size(quota)}); this blob is {size} bytes ({_size(size)})", code="quota_exceeded")
    return used, already


@routes.put("/v1/blobs/{sha256}")
@describe(auth="owner", response=api.BlobStored, status=201)
async def upload_blob(request: web.Request) -> web.Response:
    """Upload bytes named by their SHA-256 (raw body, Content-Length required); the owner then holds them. Bytes
    the store already has are checked the same way and stored once. 413 over the per-artifact cap, 403
    `quota_exceeded` over the owner's quota, 400 `digest_mismatch` when the bytes are not the digest's."""
    config = request.app[CONFIG]
    sha256 = digest_in_path(request)
    owner = await owner_of(request)
    size = request.content_length
    if size is None:
        raise LengthRequired("a blob upload needs a Content-Length header (the blob's size)")
    if size > config.max_artifact_bytes:
        raise PayloadTooLarge(f"the blob is {size} bytes; the coordinator stores at most {config.max_artifact_bytes} "
                              f"bytes ({_size(config.max_artifact_bytes)}) per blob")
    async with request.app[SESSIONS]() as session:
        await check_quota(session, owner.id, sha256, size, config.owner_quota_bytes)
    staged = await receive(request, sha256, size)
    try:
        async with request.app[BLOB_LOCK]:
            now = time.time()
            async with request.app[SESSIONS].begin() as session:
                # Again, in the transaction: another upload of this owner may have finished meanwhile.
                used, already = await check_quota(session, owner.id, sha256, size, config.owner_quota_bytes)
                await staged.commit()
                await blobs.record_upload(session, owner.id, sha256, size, now)
                held = used if already else used + size
    finally:
        await staged.discard()
    logger.info("owner %s uploaded blob %s (%d bytes)", owner.id, sha256[:12], size)
    return respond(api.BlobStored, {"ok": True, "sha256": sha256, "size": size, "held_bytes": held,
                                    "quota_bytes": config.owner_quota_bytes}, status=201)


@routes.get("/v1/blobs/{sha256}")
@describe(auth="owner")
async def download_blob(request: web.Request) -> web.StreamResponse:
    """Download a blob the calling owner holds (header X-Content-SHA256); 404 `unknown_blob` otherwise, whoever
    else may hold it."""
    sha256 = digest_in_path(request)
    async with request.app[SESSIONS].begin() as session:
        owner = await current_owner(request, session)
        held = await session.get(BlobHolder, (owner.id, sha256))
        if held is None:
            raise NotFound(f"you hold no blob {sha256[:12]}… (upload it first)", code="unknown_blob")
        await blobs.touch(session, [sha256], time.time())
    return await serve_blob(request, sha256)


@routes.get("/v1/jobs/{job_id}/blobs/{sha256}", allow_head=False)  # a HEAD would use up a signed fetch
@describe(auth="node", body=BlobFetch, signed="fetch")
async def fetch_blob(request: web.Request) -> web.StreamResponse:
    """Node: read the code, dataset or an artifact (checkpoint, model) of a job it holds an active assignment in.
    The signed BlobFetch travels in the X-Gpuswarm-Envelope header (a GET has no body); its nonce is used up."""
    sha256 = digest_in_path(request)
    message = verify_signed(envelope_header(request), "fetch", BlobFetch)
    fetch = message.payload
    if fetch.job_id != request.match_info["job_id"] or fetch.sha256 != sha256:
        raise BadRequest("the signed job id and digest do not match the URL")
    async with request.app[SESSIONS].begin() as session:
        await authenticate_node(session, message)
        job = await jobs.get_job(session, fetch.job_id)
        await blobs.node_may_read(session, job, fetch.node_id, sha256)
        await blobs.touch(session, [sha256], time.time())
    return await serve_blob(request, sha256)

