"""The node's command group: `gpuswarm node start`, `node id`, `node evaluate`, `node sandbox-check`.

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
                                             help="Coordinator base URL; several, comma-separated, to fail "
                                                  "over between the coordinators of one database.")
                   ] = "http://127.0.0.1:8470",
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
    allow_custom_code: Annotated[bool, typer.Option(
        "--allow-custom-code/--builtin-only", envvar="GPUSWARM_ALLOW_CUSTOM_CODE",
        help="Run job owners' own training code (advertised; the matcher sends such jobs only to nodes that "
             "opted in). Built-in workloads run either way.")] = False,
    cache_gb: Annotated[float, typer.Option(min=0.001, help="Bound of the artifact cache (job code, datasets, "
                                            "checkpoints) under STATE_DIR/cache, in GiB.")] = 20.0,
    sandbox_memory_gb: Annotated[float, typer.Option(min=0.1, help="Memory one job's code may use (cgroup "
                                                     "memory.max, else RLIMIT_DATA), in GiB.")] = 8.0,
    sandbox_processes: Annotated[int, typer.Option(min=16, help="Processes and threads one job's code may run "
                                                   "(cgroup pids.max, else RLIMIT_NPROC).")] = 256,
    step_timeout: Annotated[float, typer.Option(min=1.0, help="Seconds a job's code may take for one step, "
                                                "evaluation or save before it is stopped as hung.")] = 600.0,
    max_job_hours: Annotated[float | None, typer.Option(min=0.001, help="Wall-time limit of one job on this "
                                                        "node, in hours (default: none).")] = None,
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
    from gpuswarm.node import sandbox
    from gpuswarm.node.trainer_link import Settings

    if allow_custom_code and (why := sandbox.unavailable_reason()) is not None:
        log.error("--allow-custom-code: not offered, because this node cannot sandbox job owners' code (%s); it "
                  "runs built-in workloads only", why)
        allow_custom_code = False
    limits = sandbox.Limits(memory_bytes=int(sandbox_memory_gb * 2**30), processes=sandbox_processes)
    if not mesh:
        log.warning("--no-mesh: hivemind traffic on %s is NOT encrypted (development only)", host)
    config = NodeConfig(coordinator_url=coordinator, state_dir=state_dir, host=host, price_per_gpu_hour=price,
                        endpoints=[host], mesh=mesh, mesh_listen_port=listen_port, mesh_endpoints=endpoint or [],
                        metrics_host=metrics_host, metrics_port=metrics_port, allow_custom_code=allow_custom_code,
                        cache_max_bytes=int(cache_gb * 1024**3), max_job_hours=max_job_hours,
                        sandbox=Settings(limits=limits, answer_timeout=step_timeout))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with CoordinatorClient(coordinator, identity) as client:
            resources = probe(force_cpu=cpu).model_copy(update={"custom_code": allow_custom_code})
            await NodeDaemon(config, identity, resources, client).run(stop)

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
    """Rebuild a built-in workload's saved model and measure it again on the workload's fixed held-out data.

    A model trained by a job owner's own code needs that code: this prints the metrics the job saved with it and
    exits with status 2."""
    with needs_extra("node"):
        from gpuswarm.node.workloads.saved import evaluate_builtin, read_model_file
        from gpuswarm.sdk.loader import WorkloadError

    try:
        saved = read_model_file(model)
    except (OSError, ValueError) as e:
        typer.echo(f"error: cannot read {model}: {e}", err=True)
        raise typer.Exit(1) from None
    reported = saved.metrics

    def _format_metrics(metrics: dict[str, float]) -> str:
        return ", ".join(f"{name} {value:.4f}" for name, value in sorted(metrics.items()))

    if saved.workload is None:
        message = (f"{model}: trained by the job owner's code ({saved.entrypoint}); re-evaluating it needs that "
                   "code (torch.load the file and load its state_dict into the owner's model class)")
        if as_json:
            typer.echo(json.dumps({"model": str(model), "workload": None, "entrypoint": saved.entrypoint,
                                   "metrics": None, "reported_metrics": reported, "needs_owner_code": True}))
        else:
            typer.echo(message)
            if reported:
                typer.echo(f"  metrics saved with it: {_format_metrics(reported)}")
        raise typer.Exit(2)
    try:
        metrics = evaluate_builtin(saved)
    except (WorkloadError, KeyError, RuntimeError, ValueError) as e:  # unknown built-in, bad params, wrong shapes
        typer.echo(f"error: cannot evaluate {model}: {e}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps({"model": str(model), "workload": saved.workload, "metrics": metrics,
                               "reported_metrics": reported, "accuracy": metrics.get("accuracy"),
                               "reported_accuracy": reported.get("accuracy")}))
    else:
        typer.echo(f"{model}: {saved.workload} {_format_metrics(metrics)}"
                   + (f" (reported {_format_metrics(reported)})" if reported else ""))


@node_app.command("sandbox-check")
def sandbox_check(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Run hostile probes (read the node's key, reach the network, fork-bomb, ...) inside this node's job sandbox
    and show whether each was contained. Exit status 0 when all were, 1 otherwise or when this node cannot
    sandbox (bubblewrap missing or not working)."""
    from gpuswarm.node.sandboxcheck import report

    output, code = report(as_json)
    typer.echo(output)
    raise typer.Exit(code)
