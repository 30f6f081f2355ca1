"""Who may call what: job owners (API tokens), the admin (one token), and creating owner accounts.

Owns token generation and hashing, the `Authorization: Bearer` parsing, and `create_owner`. Nodes are not here:
they sign every request with their Ed25519 key (see `views.known_node`).

Tokens are 256-bit random strings; the database keeps only their SHA-256. A slow password hash (bcrypt, argon2)
protects low-entropy secrets chosen by people; for random tokens a fast hash is as safe and costs nothing per
request (docs/decisions/0009-owner-accounts-and-escrow.md).
"""

from __future__ import annotations

import hashlib
import secrets

from aiohttp import web
from gpuswarm.coordinator.config import ADMIN_TOKEN, SESSIONS
from gpuswarm.coordinator.db import Job, Owner
from gpuswarm.coordinator.errors import Conflict, Forbidden, Unauthorized
from gpuswarm.coordinator.ledger import MINT, micro, owner_account, transfer
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

TOKEN_PREFIX = "gso_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    return header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""


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
    await transfer(session, MINT, owner_account(owner.id), micro(initial_credits), "grant", now,
                   memo="initial credits")
    return owner, token
