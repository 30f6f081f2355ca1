"""Relays for node pairs with no direct path: which peer forwards for which pair, and the routes that follow.

Two nodes of the mesh may have no working path between them (a firewall, two NATs that never meet, a broken
link) while both reach a third. WireGuard routes by destination address (each peer's AllowedIPs), so a relay is a
routing change and nothing more: both ends move the other's /32 into the relay's AllowedIPs, and the relay, which
already has both as peers, forwards between them on its WireGuard interface. Traffic stays end-to-end encrypted
only hop by hop (the relay sees the inner packets, as any router in the mesh would; hivemind's own traffic is
already authenticated by its libp2p peer ids).

Two pure functions:
- `plan_relays` (the coordinator's leader, every tick): from what nodes report (RTTs over settled paths, and the
  peers they have had no path to for a while), the relay of each pair that needs one. A pair needs a relay when
  either end reports the other unreachable; its relay must reach both ends directly (a reported RTT, and neither
  side of that link reports it unreachable), so a relay never relays through another. A relay keeps its pairs
  while it still qualifies (a change of relay drops a few packets, and both ends must switch together); a new pair
  gets the candidate with the lowest sum of the two RTTs, then the fewest pairs already relayed, then the lowest
  node id. A pair that no node reaches both ends of stays unrelayed (and unreachable).
- `allowed_ips` (each node, on every peer list): the AllowedIPs per peer that a `MeshConfig` asks for. Both ends of
  a pair get the same relay from the coordinator, so the relay's forwarded packets pass each end's source check
  (a packet from A arriving over the relay's session is accepted only when A's /32 is in the relay's AllowedIPs).

No I/O, no clock; imports only the wire models.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuswarm.proto.models import MeshConfig

Pair = tuple[str, str]  # node ids, sorted


def pair(a: str, b: str) -> Pair:
    return (a, b) if a < b else (b, a)


def _direct_rtt(a: str, b: str, rtts: Mapping[str, Mapping[str, float]],
                unreachable: Mapping[str, Iterable[str]]) -> float | None:
    """The RTT of a working direct link between a and b (the lower of the two ends' reports), or None."""
    if b in unreachable.get(a, ()) or a in unreachable.get(b, ()):
        return None
    found = [r for r in (rtts.get(a, {}).get(b), rtts.get(b, {}).get(a)) if r is not None]
    return min(found) if found else None


def plan_relays(nodes: Iterable[str], rtts: Mapping[str, Mapping[str, float]],
                unreachable: Mapping[str, Iterable[str]], previous: Mapping[Pair, str]) -> dict[Pair, str]:
    """{pair: relay node id} for every pair of `nodes` that needs a relay and has one.

    `rtts[a][b]`: the RTT in ms a measured to b over a direct path; `unreachable[a]`: the peers a has had no path
    to for a while; `previous`: the plan now in force. Nodes not in `nodes` (offline, revoked) take no part."""
    members = sorted(set(nodes))
    present = set(members)
    needing = sorted({pair(a, b) for a in members for b in unreachable.get(a, ()) if b in present and b != a})
    plan: dict[Pair, str] = {}
    load: dict[str, int] = {}

    def cost(a: str, b: str, relay: str) -> float | None:
        first, second = _direct_rtt(a, relay, rtts, unreachable), _direct_rtt(relay, b, rtts, unreachable)
        return None if first is None or second is None else first + second

    # Pairs that keep their relay go first, so the load of new choices counts them.
    kept = [p for p in needing if p in previous and previous[p] in present and previous[p] not in p
            and cost(*p, previous[p]) is not None]
    for p in kept:
        plan[p] = previous[p]
        load[previous[p]] = load.get(previous[p], 0) + 1
    for a, b in needing:
        if (a, b) in plan:
            continue
        scored = [(c, load.get(r, 0), r) for r in members if r not in (a, b) and (c := cost(a, b, r)) is not None]
        if scored:
            relay = min(scored)[2]
            plan[(a, b)] = relay
            load[relay] = load.get(relay, 0) + 1
    return plan


def allowed_ips(config: MeshConfig) -> dict[str, frozenset[str]]:
    """{peer public key: its AllowedIPs}: each peer's own /32, except that a peer reached through a relay has none
    and its /32 goes to the relay. A relay that is not itself a direct peer here is ignored (the peer keeps its
    /32: better a path that may work than none)."""
    by_id = {p.node_id: p for p in config.peers}
    routes = {p.public_key: {f"{p.address}/32"} for p in config.peers}
    for p in config.peers:
        relay = by_id.get(p.via) if p.via else None
        if relay is None or relay.via is not None or relay.node_id == p.node_id:
            continue
        routes[p.public_key].discard(f"{p.address}/32")
        routes[relay.public_key].add(f"{p.address}/32")
    return {key: frozenset(ips) for key, ips in routes.items()}
