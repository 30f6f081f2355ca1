"""A mesh node for the netns tests: run inside a lab namespace, it owns UserspaceBackends and takes orders.

One JSON object per line on stdin, one reply per line on stdout ({"ok": true, ...} or {"ok": false, "error"}).
Orders: up, peer, remove, reconcile, status, down; each names a `slot` (default "main") so that one node can hold
a second backend for failure tests. On end of input or SIGTERM every backend is taken down.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from dataclasses import asdict

from gpuswarm.mesh.backend import BackendError, PeerConfig, UserspaceBackend
from gpuswarm.mesh.reconciler import MeshAgent

backends: dict[str, UserspaceBackend] = {}


def peer_from(msg: dict) -> PeerConfig:
    return PeerConfig(
        msg["public_key"], frozenset(msg["allowed_ips"]), msg.get("endpoint"), msg.get("persistent_keepalive", 0)
    )


def handle(msg: dict) -> dict:
    op = msg["op"]
    slot = msg.get("slot", "main")
    if op == "up":
        backend = UserspaceBackend(stop_timeout=2.0)
        try:
            backend.up(msg["address"], msg["cidr"], msg["listen_port"], msg["private_key"])
        except BackendError as e:
            return {
                "ok": False,
                "error": str(e),
                "running": backend.is_running(),
                "socket_left": backend.socket_path.exists(),
            }
        backends[slot] = backend
        return {"ok": True, "interface": backend.interface, "pid": backend.pid}
    backend = backends[slot]
    if op == "peer":
        backend.add_or_update_peer(peer_from(msg), fields=msg.get("fields"))
        return {"ok": True}
    if op == "remove":
        backend.remove_peer(msg["public_key"])
        return {"ok": True}
    if op == "reconcile":
        changes = MeshAgent(backend).reconcile([peer_from(p) for p in msg["peers"]])
        return {"ok": True, "changes": [{"kind": str(c.kind), "public_key": c.public_key,
                                         "fields": sorted(c.fields)} for c in changes]}
    if op == "status":
        return {"ok": True, "status": asdict(backend.status())}
    if op == "down":
        backends.pop(slot).down()
        return {"ok": True}
    return {"ok": False, "error": f"unknown op {op!r}"}


def shutdown(*_: object) -> None:
    for backend in backends.values():
        backend.down(timeout=2.0)
    backends.clear()
    sys.exit(0)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGTERM, shutdown)
    try:
        for line in sys.stdin:
            try:
                reply = handle(json.loads(line))
            except Exception as e:  # the test reads the error; the node stays up for the next order
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(reply), flush=True)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
