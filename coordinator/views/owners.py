"""Handlers of job owners' accounts: the admin creates owners and adjusts credits, an owner reads its account.

Owns POST /v1/owners, GET /v1/owners/me and POST /v1/owners/{owner_id}/credits. Tokens and accounts are
`auth`'s, balances and transfers `ledger`'s.
"""

from __future__ import annotations

import time

from aiohttp import web
from gpuswarm.coordinator import ledger
from gpuswarm.coordinator.auth import create_owner, current_owner, require_admin
from gpuswarm.coordinator.config import SESSIONS
from gpuswarm.coordinator.db import Owner
from gpuswarm.coordinator.errors import Conflict, NotFound
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.requests import parse, read_json
from gpuswarm.coordinator.views import shapes
from gpuswarm.proto import api
from gpuswarm.proto.models import CreditAdjustment, NewOwner
from sqlalchemy.ext.asyncio import AsyncSession

routes = web.RouteTableDef()


async def _owner_json(session: AsyncSession, owner: Owner) -> dict:
    return shapes.owner_json(owner, await ledger.balance(session, ledger.owner_account(owner.id)))


@routes.post("/v1/owners")
@describe(auth="admin", body=NewOwner, response=api.OwnerCreated, status=201)
async def new_owner(request: web.Request) -> web.Response:
    """Admin: create a job owner's account with initial credits; the token is in this response only."""
    require_admin(request)
    body = parse(NewOwner, await read_json(request), "owner")
    async with request.app[SESSIONS].begin() as session:
        owner, token = await create_owner(session, body.name, body.credits, time.time())
    return respond(api.OwnerCreated, shapes.new_owner_json(owner, token, body.credits), status=201)


@routes.get("/v1/owners/me")
@describe(auth="owner", response=api.OwnerAccount)
async def whoami(request: web.Request) -> web.Response:
    """The calling owner's account and balance."""
    async with request.app[SESSIONS]() as session:
        owner = await current_owner(request, session)
        return respond(api.OwnerAccount, await _owner_json(session, owner))


@routes.post("/v1/owners/{owner_id}/credits")
@describe(auth="admin", body=CreditAdjustment, response=api.OwnerAccount)
async def adjust_credits(request: web.Request) -> web.Response:
    """Admin: grant (positive) or withdraw (negative) credits; an owner's balance never goes below zero."""
    require_admin(request)
    body = parse(CreditAdjustment, await read_json(request), "credit adjustment")
    now = time.time()
    async with request.app[SESSIONS].begin() as session:
        owner = await session.get(Owner, request.match_info["owner_id"])
        if owner is None:
            raise NotFound(f"no owner {request.match_info['owner_id']!r}", code="unknown_owner")
        account, amount = ledger.owner_account(owner.id), ledger.micro(body.amount)
        if amount < 0 and await ledger.balance(session, account) < -amount:
            raise Conflict("the adjustment would make the balance negative", code="insufficient_funds")
        if amount > 0:
            await ledger.mint(session, account, amount, "adjust", now, memo=body.memo)
        else:
            ledger.transfer(session, account, ledger.MINT, -amount, "adjust", now, memo=body.memo)
        return respond(api.OwnerAccount, await _owner_json(session, owner))
