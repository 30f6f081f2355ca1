"""Who may call what: nodes (signed messages), job owners (API tokens), the admin (one token), and owner accounts.

Owns the one definition of an authentic node request, used by every node route (the heartbeat batcher included):
`verify_signed` (no database: the envelope's signature, kind and freshness, and the payload speaks for its signer)
and then `authenticate_node` (in the request's transaction: the node is registered, signed with its own key, is
not revoked, and the nonce is new, which it records). `node_refusal` is the pure rule both it and the heartbeat
batcher apply. Owns too token generation and hashing, the `Authorization: Bearer` parsing, `owned_job`, and
`create_owner`.

Tokens are 256-bit random strings; the database keeps only their SHA-256. A slow password hash (bcrypt, argon2)
protects low-entropy secrets chosen by people; for random tokens a fast hash is as safe and costs nothing per
request (docs/decisions/0009-owner-accounts-and-escrow.md).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any, Generic

from aiohttp import web
from gpuswarm.coordinator.config import ADMIN_TOKEN, SESSIONS, SIGNATURES
from gpuswarm.coordinator.db import Job, Node, Owner, SeenNonce, remember_nonce
from gpuswarm.coordinator.errors import ApiError, Conflict, Forbidden, NotFound, Unauthorized
from gpuswarm.coordinator.jobs import get_job
from gpuswarm.coordinator.ledger import micro, mint, owner_account
from gpuswarm.coordinator.requests import M, parse, read_json
from gpuswarm.proto.signing import MAX_CLOCK_SKEW, SignatureError, SignedEnvelope, fresh_signer, unpack, verify
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

TOKEN_PREFIX = "gso_"


# ---------------------------------------------------------------------------------------------------- nodes


@dataclass(frozen=True)
class NodeMessage(Generic[M]):
    """A signed message whose signature, kind and freshness checked out, and whose payload's node is its signer.
    Only `verify_signed` makes one; `authenticate_node` then checks the node against the database."""

    envelope: SignedEnvelope
    payload: M

    @property
    def node_id(self) -> str:
        return self.payload.node_id

    @property
    def nonce_expires_at(self) -> float:
        """Until when the nonce must be remembered: past it, the timestamp alone makes the message stale."""
        return self.envelope.timestamp + 2 * MAX_CLOCK_SKEW


def verify_signed(data: Any, kind: str, model: type[M]) -> NodeMessage[M]:
    """The first half of node authentication (no database): a SignedEnvelope of `kind`, signed, fresh, whose
    payload is a `model` naming the signer as its node (401 `bad_signature`, 422 for a malformed envelope)."""
    envelope = parse(SignedEnvelope, data, "signed envelope")
    try:
        signer = verify(envelope, kind=kind)
    except SignatureError as e:
        raise Unauthorized(str(e), code="bad_signature") from None
    return _message(envelope, signer, kind, model)


async def read_signed(request: web.Request, kind: str, model: type[M], limit: int | None = None) -> NodeMessage[M]:
    """`verify_signed` of the request's JSON body (at most `limit` bytes; default: the JSON cap), with the
    signature checked by the app's `SignatureChecker` (another core) where it has one."""
    data = await read_json(request, limit)
    if (checker := request.app.get(SIGNATURES)) is None:
        return verify_signed(data, kind, model)
    envelope = parse(SignedEnvelope, data, "signed envelope")
    try:
        if not await checker.check(*unpack(envelope, kind=kind)):
            raise SignatureError("bad signature")
        signer = fresh_signer(envelope)
    except SignatureError as e:
        raise Unauthorized(str(e), code="bad_signature") from None
    return _message(envelope, signer, kind, model)


def _message(envelope: SignedEnvelope, signer: str, kind: str, model: type[M]) -> NodeMessage[M]:
    payload = parse(model, envelope.payload, kind)
    if payload.node_id != signer:
        raise Unauthorized("the payload's node_id is not the signer's", code="bad_signature")
    return NodeMessage(envelope, payload)


def node_refusal(message: NodeMessage, node: Node | None, *, nonce_seen: bool) -> ApiError | None:
    """The second half's rule, given what the database holds: why `message` is refused, or None. In this order:
    unregistered (404), signed with another key (401), revoked (403), nonce seen before (409)."""
    if node is None:
        return NotFound(f"node {message.node_id} is not registered", code="unknown_node")
    if node.public_key != message.envelope.public_key:
        return Unauthorized("signed with a key that is not this node's", code="bad_signature")
    if node.revoked:
        return Forbidden(f"node {node.id} has been revoked", code="revoked")
    if nonce_seen:
        return Conflict("replayed message: this nonce was already used", code="replay")
    return None


async def authenticate_node(session: AsyncSession, message: NodeMessage, *, record_nonce: bool = True,
                            registering: bool = False) -> Node | None:
    """The second half of node authentication, in the caller's transaction: the node that sent `message`, after
    `node_refusal`'s checks. Records the nonce, unless `record_nonce` is False (a read-only check ahead of slow
    work; the request must authenticate again, recording it, in the transaction that writes). `registering`:
    an unregistered node is allowed (None), since a registration is what makes it known."""
    node = await session.get(Node, message.node_id)
    if node is None and registering:
        await remember_nonce(session, message.envelope.nonce, message.nonce_expires_at)
        return None
    seen = not record_nonce and await session.get(SeenNonce, message.envelope.nonce) is not None
    if (refusal := node_refusal(message, node, nonce_seen=seen)) is not None:
        raise refusal
    if record_nonce:  # it looks for the nonce itself, and catches a concurrent copy of the request
        await remember_nonce(session, message.envelope.nonce, message.nonce_expires_at)
    return node


# ---------------------------------------------------------------------------------------------------- owners


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(request: web.Request) -> str:
    """The token of `Authorization: Bearer TOKEN`, "" without one. Tokens are printable ASCII: anything else (a
    non-ASCII or undecodable header) is refused as a bad token, never compared or hashed."""
    header = request.headers.get("Authorization", "")
    token = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
    if token and not (token.isascii() and token.isprintable()):
        raise Unauthorized("the Authorization token must be printable ASCII", code="bad_token")
    return token


def require_admin(request: web.Request) -> None:
    given = bearer(request)
    if not given or not secrets.compare_digest(given, request.app[ADMIN_TOKEN]):
        raise Unauthorized("this needs the admin token (Authorization: Bearer ...; see DATA_DIR/admin.token)",
                           code="admin_only")


async def current_owner(request: web.Request, session: AsyncSession) -> Owner:
    """The job owner whose token the request carries; 401 without a valid one."""
    token = bearer(request)
    if not token:
        raise Unauthorized("this needs a job owner's API token (Authorization: Bearer gso_...; "
                           "`gpuswarm coordinator create-owner` makes one)", code="no_token")
    owner = await session.scalar(select(Owner).where(Owner.token_hash == hash_token(token)))
    if owner is None:
        raise Unauthorized("unknown API token", code="bad_token")
    return owner


def check_owner(job: Job, owner: Owner) -> None:
    if job.owner_id != owner.id:
        raise Forbidden(f"job {job.id} belongs to another owner", code="not_your_job")


async def owned_job(request: web.Request, session: AsyncSession) -> Job:
    """The job named in the URL, if the request's owner token is its owner's (401/403/404 otherwise)."""
    owner = await current_owner(request, session)
    job = await get_job(session, request.match_info["job_id"])
    check_owner(job, owner)
    return job


async def owner_of(request: web.Request) -> Owner:
    async with request.app[SESSIONS]() as session:
        return await current_owner(request, session)


async def create_owner(session: AsyncSession, name: str, initial_credits: float, now: float) -> tuple[Owner, str]:
    """A new owner with `initial_credits` granted from the mint. Returns the owner and its token (shown once)."""
    if await session.scalar(select(Owner.id).where(Owner.name == name)) is not None:
        raise Conflict(f"an owner named {name!r} already exists", code="owner_exists")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    owner = Owner(id=f"o-{secrets.token_hex(6)}", name=name, token_hash=hash_token(token), created_at=now)
    session.add(owner)
    try:
        await session.flush()
    except IntegrityError:  # created by a concurrent request since the check above
        raise Conflict(f"an owner named {name!r} already exists", code="owner_exists") from None
    await mint(session, owner_account(owner.id), micro(initial_credits), "grant", now, memo="initial credits")
    return owner, token
