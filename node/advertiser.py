"""The node's DHT presence: a hivemind DHT peer and a signed advert re-declared under a TTL.

Like petals' announcer, it re-declares every `ttl / 3` seconds, warns when a declaration took longer than the
period, and says goodbye with an OFFLINE advert on shutdown (`goodbye`, bounded: a node stops within 3 s). The
advert is signed with the node's identity, and the record carries the proof every DHT record needs (the
coordinator's cert for this node, renewed from heartbeat answers by `renew`, and a session key this node binds):
`gpuswarm.dht.validators` checks both on every peer that stores or reads it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from gpuswarm.dht import hivemind_adapter
from gpuswarm.dht.swarm import SwarmDHT
from gpuswarm.dht.validators import SwarmRecordValidator, WriterProof, new_session_key, renewal_due, validators
from gpuswarm.node.identity import Identity
from gpuswarm.proto.dht import ADVERT_KIND, KEY_KIND, NODES_KEY, binding_for
from gpuswarm.proto.models import NodeAdvert, NodeState, Resources
from gpuswarm.proto.signing import SignedEnvelope

logger = logging.getLogger(__name__)
DHT_START_TIMEOUT = 60.0
DHT_STOP_TIMEOUT = 1.0  # seconds the DHT process gets to stop before it is killed (a node stops within 3 s)


class Advertiser:
    def __init__(self, identity: Identity, resources: Resources, software_version: str, price: float, host: str,
                 ttl: float):
        self.identity, self.resources, self.version, self.price = identity, resources, software_version, price
        self.host, self.ttl = host, ttl
        self.dht = None
        self.maddrs: list[str] = []  # the DHT peer's visible addresses, read once it is up (off the event loop)
        self.state = NodeState.STARTING
        self.authority: str | None = None  # the coordinator's, from its registration answer
        self.proof: WriterProof | None = None
        self._session = new_session_key()
        self._task: asyncio.Task | None = None
        # Its own threads for blocking hivemind calls, kept off asyncio's default executor (see shutdown).
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dht")

    async def start(self, initial_peers: list[str]) -> None:
        """Start the DHT peer and the first declaration; raise if the DHT cannot start (the `_ready` contract)."""
        loop = asyncio.get_running_loop()

        def start_dht():
            dht = SwarmDHT(initial_peers=initial_peers, host_maddrs=[f"/ip4/{self.host}/tcp/0"], start=False,
                           record_validators=validators(self.authority, self.proof),
                           shutdown_timeout=DHT_STOP_TIMEOUT)
            dht.run_in_background(await_ready=False)
            try:  # bounded: a DHT process that never comes up must not stall the daemon's loop
                dht.wait_until_ready(timeout=DHT_START_TIMEOUT)
                maddrs = [str(m) for m in dht.get_visible_maddrs()]  # a blocking call into the DHT process
            except BaseException:
                dht.terminate()
                raise
            return dht, maddrs

        self.dht, self.maddrs = await loop.run_in_executor(self._executor, start_dht)
        await self.declare()
        self._task = asyncio.create_task(self._run(), name="dht-advertiser")

    async def renew(self, cert: SignedEnvelope | None) -> None:
        """Take the coordinator's fresh cert for this node's advert (when due; see `renewal_due`)."""
        if cert is None or not renewal_due(self.proof, cert):
            return
        private, public = self._session
        subkeys = [hivemind_adapter.pack(self.identity.node_id)]
        binding = self.identity.sign(KEY_KIND, binding_for(cert, public, subkeys))
        self.proof = WriterProof(cert, binding, private)
        if self.dht is not None:
            validator = SwarmRecordValidator(self.authority, self.proof)
            await asyncio.get_running_loop().run_in_executor(self._executor, self.dht.add_validators, [validator])

    def advert(self, state: NodeState, expires_at: float) -> dict:
        advert = NodeAdvert(node_id=self.identity.node_id, state=state, resources=self.resources,
                            software_version=self.version, price_per_gpu_hour=self.price, maddrs=self.maddrs,
                            expires_at=expires_at)
        return self.identity.sign(ADVERT_KIND, advert.model_dump(mode="json")).model_dump(mode="json")

    async def declare(self, state: NodeState | None = None, ttl: float | None = None) -> bool:
        from hivemind.utils import get_dht_time

        expires = get_dht_time() + (ttl or self.ttl)
        value = self.advert(state or self.state, expires)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: self.dht.store(
            NODES_KEY, subkey=self.identity.node_id, value=value, expiration_time=expires))

    async def _run(self) -> None:
        period = self.ttl / 3
        while True:
            await asyncio.sleep(period)
            started = time.monotonic()
            try:
                if not await self.declare():
                    logger.warning("no DHT peer accepted our advert")
            except Exception:
                logger.exception("declaring the advert failed; retrying in %.0fs", period)
            took = time.monotonic() - started
            if took > period:
                logger.warning("declaring the advert took %.1fs, longer than its %.1fs period", took, period)

    async def goodbye(self, timeout: float = 1.0) -> None:
        """Publish the OFFLINE advert, best effort and bounded: the TTL removes the advert anyway."""
        if self._task is not None:
            self._task.cancel()
        if self.dht is None:
            return
        try:
            # hivemind keeps the later-expiring value of a subkey, so the goodbye must not expire sooner.
            await asyncio.wait_for(self.declare(NodeState.OFFLINE, ttl=max(60.0, self.ttl)), timeout=timeout)
        except Exception as e:
            logger.warning("could not publish the offline advert: %r", e)

    async def shutdown(self) -> None:
        """Stop the DHT peer: asked first, killed after DHT_STOP_TIMEOUT (SwarmDHT.terminate)."""
        if self._task is not None:
            self._task.cancel()
        if self.dht is None:
            return
        # Not on our executor: its two threads may both be held by stores still waiting on peers (the goodbye that
        # timed out, a periodic declaration), and the shutdown would queue behind them. Those threads are left to
        # end with the DHT; asyncio.run must not wait for them at exit.
        self._executor.shutdown(wait=False, cancel_futures=True)
        dht, self.dht = self.dht, None
        await asyncio.to_thread(dht.shutdown)
