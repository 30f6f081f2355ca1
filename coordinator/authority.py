"""The swarm's authority: the coordinator's Ed25519 key that every DHT record chains to (`gpuswarm.proto.dht`).

Owns the key (created once and kept in the database, so every coordinator of one PostgreSQL database signs with
the same key; whoever reads that table can issue certs, as whoever writes it can mint credits) and issuing certs:
a node's own (scope `NODE_SCOPE`: its advert) with its registration and every heartbeat answer, and a run ticket
(scope: the run id) with each active assignment it polls. A cert lives `CoordinatorConfig.dht_cert_ttl` seconds:
a node that is revoked, or loses or ends its assignment, gets no new one, and its records fail everywhere once
the last one expires. A running job rides out a coordinator outage of up to that long.

A cert is signed again only once the last one issued for the same node and scope has lived half its life: until
then every answer carries that one. Nodes take a cert only when it lasts half a life longer than theirs
(`dht.validators.renewal_due`), so a fresh signature per heartbeat bought them nothing and cost the coordinator a
tenth of a heartbeat's CPU (decision 0019).
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
        self._issued: dict[tuple[str, str], tuple[float, SignedEnvelope]] = {}  # (node, scope): (renew at, cert)
        self._prune_at = 1024  # the cache's size at which the certs due for renewal are dropped

    def node_cert(self, node_id: str, now: float | None = None) -> SignedEnvelope:
        return self._cert(node_id, NODE_SCOPE, time.time() if now is None else now)

    def run_ticket(self, node_id: str, run_id: str, now: float | None = None) -> SignedEnvelope:
        return self._cert(node_id, run_id, time.time() if now is None else now)

    def _cert(self, node_id: str, scope: str, now: float) -> SignedEnvelope:
        """The last cert issued for (node, scope) while it is younger than half its life (and not from the
        future: a clock set back), else a new one."""
        key = (node_id, scope)
        if (entry := self._issued.get(key)) is not None and entry[1].timestamp <= now < entry[0]:
            return entry[1]
        cert = issue_cert(self._key, node_id, scope, self.ttl, now)
        if len(self._issued) >= self._prune_at:  # nodes that left, runs that ended: dropped, amortised O(1)
            self._issued = {k: v for k, v in self._issued.items() if now < v[0]}
            self._prune_at = max(1024, 2 * len(self._issued))
        self._issued[key] = (now + (float(cert.payload["expires_at"]) - now) / 2, cert)
        return cert

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
