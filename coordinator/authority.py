"""The swarm's authority: the coordinator's Ed25519 key that every DHT record chains to (`gpuswarm.proto.dht`).

Owns the key (created once and kept in the database, so every coordinator of one PostgreSQL database signs with
the same key; whoever reads that table can issue certs, as whoever writes it can mint credits) and issuing certs:
a node's own (scope `NODE_SCOPE`: its advert) with its registration and every heartbeat answer, and a run ticket
(scope: the run id) with each active assignment it polls. A cert lives `CoordinatorConfig.dht_cert_ttl` seconds:
a node that is revoked, or loses or ends its assignment, gets no new one, and its records fail everywhere once
the last one expires. A running job rides out a coordinator outage of up to that long.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.coordinator.db import AuthorityKey
from gpuswarm.proto.dht import NODE_SCOPE, issue_cert
from gpuswarm.proto.signing import SignedEnvelope, public_key_b64
from sqlalchemy import exc
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

logger = logging.getLogger(__name__)


class Authority:
    def __init__(self, private_key: Ed25519PrivateKey, ttl: float):
        self._key, self.ttl = private_key, ttl
        self.public_key = public_key_b64(private_key.public_key())

    def node_cert(self, node_id: str, now: float | None = None) -> SignedEnvelope:
        return issue_cert(self._key, node_id, NODE_SCOPE, self.ttl, time.time() if now is None else now)

    def run_ticket(self, node_id: str, run_id: str, now: float | None = None) -> SignedEnvelope:
        return issue_cert(self._key, node_id, run_id, self.ttl, time.time() if now is None else now)

    def secret(self, purpose: str) -> bytes:
        """A key for `purpose` (the audit draw), derived from the authority key: the same on every coordinator of
        one database, unknown to nodes."""
        return hashlib.sha256(self._key.private_bytes_raw() + b"\0" + purpose.encode()).digest()


async def load(sessions: async_sessionmaker[AsyncSession], ttl: float) -> Authority:
    """The authority key from the database, created on first use (two coordinators starting together agree:
    the second insert fails on the primary key and reads the first's)."""
    async with sessions() as session:
        row = await session.get(AuthorityKey, 1)
    if row is None:
        raw = base64.b64encode(Ed25519PrivateKey.generate().private_bytes_raw()).decode()
        with contextlib.suppress(exc.IntegrityError):
            async with sessions.begin() as session:
                session.add(AuthorityKey(id=1, private_key=raw, created_at=time.time()))
            logger.info("created the swarm's authority key")
        async with sessions() as session:
            row = await session.get(AuthorityKey, 1)
    return Authority(Ed25519PrivateKey.from_private_bytes(base64.b64decode(row.private_key)), ttl)
