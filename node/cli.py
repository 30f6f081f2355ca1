"""The node's command group: `gpuswarm node start`, `gpuswarm node id`, `gpuswarm node evaluate`.

`start` and `evaluate` need the gpuswarm[node] install (torch, hivemind, ...): their imports are inside them, so
`gpuswarm --help` and the other groups work without it, and a missing extra is named when they run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from gpuswarm.proto import logs
from gpuswarm.proto.logs import LogFormat, LogLevel

from gpuswarm.console import needs_extra

log = logging.getLogger("gpuswarm.node")
node_app = typer.Typer(help="Run a GPU node daemon.", no_args_is_help=True)


@node_app.command("start")
def start(
    coordinator: Annotated[str, typer.Option("--coordinator", "-c", envvar="GPUSWARM_COORDINATOR",
                                             help="Coordinator base URL.")] = "http://127.0.0.1:8470",
    state_dir: Annotated[Path, typer.Option(help="Identity key, outbox and job files.")] = Path("var/node"),
    host: Annotated[str, typer.Option(help="Address hivemind binds and announces (loopback or LAN; the mesh "
                                           "address once the WireGuard mesh exists).")] = "127.0.0.1",
    price: Annotated[float, typer.Option(help="Ask price per GPU-hour.")] = 0.0,
    cpu: Annotated[bool, typer.Option("--cpu", help="Offer CPU only, even if GPUs are present.")] = False,
    mesh: Annotated[bool, typer.Option("--mesh/--no-mesh", help="Join the WireGuard mesh (needs root and "
                                       "wireguard-go or the kernel module). --no-mesh: loopback or LAN, "
                                       "UNENCRYPTED, for development.")] = True,
    listen_port: Annotated[int, typer.Option(help="WireGuard UDP port.")] = 51820,
    endpoint: Annotated[list[str] | None, typer.Option(help="HOST:PORT where peers can reach this node's "
                                                       "WireGuard (repeatable; default: local addresses).")] = None,
    metrics_port: Annotated[int, typer.Option(min=0, max=65535, help="Serve Prometheus metrics at "
                                              "http://METRICS_HOST:PORT/metrics (9465 is customary); 0: off.")] = 0,
    metrics_host: Annotated[str, typer.Option(help="Address the metrics endpoint binds (it is unauthenticated: "
                                              "keep it on loopback or a private network).")] = "127.0.0.1",
    log_level: LogLevel = "info",
    log_format: LogFormat = "text",
) -> None:
    """Register with the coordinator, advertise this machine in the DHT, and train assigned jobs until SIGTERM."""
    from gpuswarm.client.api import CoordinatorClient
    from gpuswarm.node.identity import IdentityError, load_or_create

    with needs_extra("node"):
        from gpuswarm.node.daemon import NodeConfig, NodeDaemon, NodeRevoked
        from gpuswarm.node.gpu import probe
        from gpuswarm.node.meshlink import MeshUnavailable
        from gpuswarm.node.metrics import MetricsUnavailable

    logs.configure(log_level, log_format, "node")
    try:
        identity = load_or_create(state_dir)
    except IdentityError as e:
        log.error("%s", e)
        raise typer.Exit(1) from None
    if not mesh:
        log.warning("--no-mesh: hivemind traffic on %s is NOT encrypted (development only)", host)
    config = NodeConfig(coordinator_url=coordinator, state_dir=state_dir, host=host, price_per_gpu_hour=price,
                        endpoints=[host], mesh=mesh, mesh_listen_port=listen_port, mesh_endpoints=endpoint or [],
                        metrics_host=metrics_host, metrics_port=metrics_port)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with CoordinatorClient(coordinator, identity) as client:
            await NodeDaemon(config, identity, probe(force_cpu=cpu), client).run(stop)

    code = 0
    try:
        asyncio.run(main())
    except (MeshUnavailable, MetricsUnavailable, NodeRevoked) as e:
        log.error("%s", e)
        code = 1
    # The daemon's own shutdown is bounded and done by now. A hivemind call that outlived its DHT can leave an
    # executor thread blocked, and interpreter exit would wait for it; so leave without waiting.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@node_app.command("id")
def node_id(
    state_dir: Annotated[Path, typer.Option(help="The node's state directory.")] = Path("var/node"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print this node's id (created with its key on first use)."""
    from gpuswarm.node.identity import load_or_create

    identity = load_or_create(state_dir)
    typer.echo(json.dumps({"node_id": identity.node_id, "public_key": identity.public_key}) if as_json
               else identity.node_id)


@node_app.command("evaluate")
def evaluate(
    model: Annotated[Path, typer.Argument(help="A model file saved by a job (see `gpuswarm job download`).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Load a saved model and measure its accuracy on the workload's fixed test split."""
    with needs_extra("node"):
        import torch
        from gpuswarm.node.workloads import IMPLEMENTATIONS

    try:
        saved = torch.load(model, map_location="cpu", weights_only=True)
        workload = IMPLEMENTATIONS[saved["workload"]]
        accuracy = workload.evaluate_saved(str(model))
    except (OSError, KeyError, RuntimeError, ValueError) as e:
        typer.echo(f"error: cannot evaluate {model}: {e!r}", err=True)
        raise typer.Exit(1) from None
    reported = saved.get("metadata", {}).get("accuracy")
    if as_json:
        typer.echo(json.dumps({"model": str(model), "workload": saved["workload"], "accuracy": accuracy,
                               "reported_accuracy": reported}))
    else:
        typer.echo(f"{model}: {saved['workload']} test accuracy {accuracy:.4f} (reported {reported:.4f})"
                   if reported is not None else f"{model}: test accuracy {accuracy:.4f}")
