"""One peer of the all-reduce benchmark (scripts/bench/allreduce.py), run inside a lab namespace.

Holds the peer's WireGuard interface (the product's userspace backend and reconciler) and runs the rounds it is
told to. One JSON object per line on stdin, one answer per line on stdout ({"ok": true, ...} or {"ok": false,
"error": ...}):
- up {address, cidr, listen_port, private_key}; peers {peers: [{public_key, allowed_ips, endpoint}]}
- dht {host, initial_peers}: a hivemind DHT on the mesh address; answers its multiaddrs
- prepare {kind: "hivemind", numel, compression, group, prefix, [options]} | {kind: "gloo", numel, rank, world,
  master}: builds the averager (or the gloo group) and, for hivemind, forms the group of `group` peers, stopping
  just before the all-reduce; answers when ready. The averager runs with the product's settings
  (`gpuswarm.dht.hivemind_adapter.averager_options` and `averager_compression`); `options` overrides some of
  them, to measure another setting beside them
- run: does the all-reduce (hivemind: triggers the round formed by prepare; gloo: one all_reduce) and answers
  its seconds, from the trigger to this peer's result
- close: drops the averager or the gloo group
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch
from gpuswarm.mesh.backend import PeerConfig, UserspaceBackend
from gpuswarm.mesh.reconciler import MeshAgent

state: dict = {}


def handle(msg: dict) -> dict:
    op = msg["op"]
    if op == "up":
        backend = UserspaceBackend(stop_timeout=2.0)
        backend.up(msg["address"], msg["cidr"], msg["listen_port"], msg["private_key"])
        state["backend"] = backend
        return {"interface": backend.interface}
    if op == "peers":
        peers = [PeerConfig(p["public_key"], frozenset(p["allowed_ips"]), p["endpoint"], 5) for p in msg["peers"]]
        MeshAgent(state["backend"]).reconcile(peers)
        return {}
    if op == "dht":
        import hivemind

        dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{msg['host']}/tcp/0"], initial_peers=msg["initial_peers"])
        state["dht"] = dht
        return {"maddrs": [str(m) for m in dht.get_visible_maddrs()]}
    if op == "prepare" and msg["kind"] == "hivemind":
        from gpuswarm.dht.hivemind_adapter import averager_compression, averager_options
        from hivemind.averaging import DecentralizedAverager
        from hivemind.averaging.control import AveragingStage
        from hivemind.utils import get_dht_time

        averager = state.get("averager")
        options = {**averager_options(), **msg.get("options", {})}
        key = (msg["numel"], msg["compression"], msg["prefix"], json.dumps(options, sort_keys=True))
        if averager is None or state.get("averager_key") != key:
            if averager is not None:
                averager.shutdown()
            averager = DecentralizedAverager(
                averaged_tensors=[torch.randn(msg["numel"])], dht=state["dht"], prefix=msg["prefix"],
                target_group_size=msg["group"], min_group_size=msg["group"], min_matchmaking_time=2.0,
                request_timeout=1.0, compression=averager_compression(msg["compression"]), start=True, **options)
            state["averager"], state["averager_key"] = averager, key
        control = averager.step(wait=False, require_trigger=True, scheduled_time=get_dht_time() + 3.0,
                                timeout=600, allow_retries=False)
        deadline = time.monotonic() + 120
        while control.stage != AveragingStage.AWAITING_TRIGGER:
            if control.done() or time.monotonic() > deadline:
                raise RuntimeError(f"no group formed: {control.stage} {control.exception() if control.done() else ''}")
            time.sleep(0.01)
        state["control"] = control
        return {}
    if op == "prepare" and msg["kind"] == "gloo":
        import os

        import torch.distributed as dist

        os.environ["GLOO_SOCKET_IFNAME"] = state["backend"].interface
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://{msg['master']}:29500", rank=msg["rank"],
                                    world_size=msg["world"])
        state["tensor"] = torch.randn(msg["numel"])
        dist.barrier()
        return {}
    if op == "run":
        t0 = time.perf_counter()
        if "control" in state:
            control = state.pop("control")
            control.allow_allreduce()
            if control.result(600) is None:
                raise RuntimeError("the round failed")
            seconds = time.perf_counter() - t0
            with state["averager"].get_tensors() as tensors:
                checksum = float(tensors[0].double().sum())
        else:
            import torch.distributed as dist

            dist.all_reduce(state["tensor"])
            seconds = time.perf_counter() - t0
            checksum = float(state["tensor"].double().sum())
        # Every peer holds the same result after a whole round; a round that lost parts leaves them different.
        return {"seconds": seconds, "checksum": checksum}
    if op == "close":
        if state.get("averager") is not None:
            state.pop("averager").shutdown()
        return {}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        for line in sys.stdin:
            try:
                reply = {"ok": True, **handle(json.loads(line))}
            except Exception as e:  # the driver reads the error and decides
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(reply), flush=True)
    finally:
        if state.get("averager") is not None:
            state["averager"].shutdown()
        if state.get("dht") is not None:
            state["dht"].shutdown()
        if state.get("backend") is not None:
            state["backend"].down(timeout=2.0)


if __name__ == "__main__":
    main()
