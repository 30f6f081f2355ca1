"""`gpuswarm node status`: this node at a glance, from its own state directory and the coordinator.

Owns `gather`: the node's id (its key; nothing is created), what the coordinator says of it (state, online,
verified, reputation, the jobs it holds and, from its statement, its balance and earnings per job), the mesh as
the daemon last wrote it (`mesh.json`: interface, address, peers by path state) and its GPUs' live readings
(NVML, when present). Each part that cannot be had says why instead of failing the others.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from gpuswarm.node.settings import NodeSettings


def _coordinator(url: str, node_id: str, timeout: float) -> dict:
    from gpuswarm.client.api import ApiError, SyncClient

    try:
        with SyncClient(url, timeout=timeout) as api:
            mine = [n for n in api.nodes() if n.id == node_id]
            if not mine:
                return {"error": "the coordinator does not know this node (not registered yet?)"}
            node, statement = mine[0], api.node_statement(node_id)
    except ApiError as e:
        return {"error": str(e)}
    return {"state": node.state.value, "online": node.online, "verified": node.verified,
            "reputation": node.reputation, "price_per_gpu_hour": node.price_per_gpu_hour, "jobs": node.job_ids,
            "balance": statement.balance,
            "earnings": [{"job_id": j.job_id, "earned": j.earned, "compute_seconds": j.compute_seconds,
                          "flagged": j.flagged} for j in statement.jobs]}


def _mesh(state_dir: Path) -> dict:
    try:
        saved = json.loads((state_dir / "mesh.json").read_text())
    except (OSError, ValueError):
        return {"error": "no mesh.json (mesh off, or the daemon has not brought it up)"}
    peers = saved.get("peers", {})
    paths = Counter((p.get("path") or {}).get("state", "unknown") for p in peers.values())
    return {"interface": saved.get("interface"), "address": saved.get("address"), "peers": len(peers),
            "paths": dict(paths)}


def _gpus() -> list[dict]:
    from gpuswarm.node.metrics import GpuReader

    reader = GpuReader()
    try:
        return [{"index": s.index, "utilization": s.utilization_ratio, "memory_used_gb": s.memory_used_bytes / 2**30,
                 "memory_total_gb": s.memory_total_bytes / 2**30} for s in reader.read()]
    finally:
        reader.close()


def gather(settings: NodeSettings, timeout: float = 5.0) -> dict:
    from gpuswarm.node.identity import KEY_FILE, load_or_create

    state_dir = settings.state_dir
    if not (state_dir / KEY_FILE).exists():
        return {"error": f"no node identity in {state_dir}: this node has never started there"}
    node_id = load_or_create(state_dir).node_id
    url = settings.coordinator.split(",")[0].strip()
    return {"node_id": node_id, "state_dir": str(state_dir), "coordinator_url": url,
            "coordinator": _coordinator(url, node_id, timeout), "mesh": _mesh(state_dir), "gpus": _gpus()}
