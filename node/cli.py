"""The node's command group: `gpuswarm node start`, `node init`, `node self-test`, `node status`, `node id`,
`node evaluate`, `node sandbox-check`. Settings come from `gpuswarm.node.settings` (file, environment, flags).

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from gpuswarm.proto import logs

from gpuswarm.console import console, fail, needs_extra

log = logging.getLogger("gpuswarm.node")
node_app = typer.Typer(help="Run a GPU node daemon.", no_args_is_help=True)


def _help(name: str) -> str:
    from gpuswarm.node.settings import NodeSettings

    return NodeSettings.model_fields[name].description or ""


CoordinatorOption = Annotated[str | None, typer.Option("--coordinator", "-c", envvar="GPUSWARM_COORDINATOR",
                                                       help=_help("coordinator"))]
StateDirOption = Annotated[Path | None, typer.Option(help=_help("state_dir"))]
CpuOption = Annotated[bool | None, typer.Option("--cpu/--no-cpu", help=_help("cpu"))]
MeshOption = Annotated[bool | None, typer.Option("--mesh/--no-mesh", help=_help("mesh"))]
CustomCodeOption = Annotated[bool | None, typer.Option("--allow-custom-code/--builtin-only",
                                                       envvar="GPUSWARM_ALLOW_CUSTOM_CODE",
                                                       help=_help("allow_custom_code"))]
CacheOption = Annotated[float | None, typer.Option(help=_help("cache_gb"))]
ConfigFile = Annotated[Path | None, typer.Option(
    "--config", help="TOML settings (`gpuswarm node init` writes one); default: $GPUSWARM_NODE_CONFIG, else "
                     "/etc/gpuswarm/node.toml if it exists. Flags override it, and GPUSWARM_NODE_* variables too.")]


@node_app.command("start")
def start(
    config: ConfigFile = None,
    coordinator: CoordinatorOption = None,
    state_dir: StateDirOption = None,
    host: Annotated[str | None, typer.Option(help=_help("host"))] = None,
    price: Annotated[float | None, typer.Option(help=_help("price"))] = None,
    cpu: CpuOption = None,
    mesh: MeshOption = None,
    listen_port: Annotated[int | None, typer.Option(help=_help("listen_port"))] = None,
    endpoint: Annotated[list[str] | None, typer.Option(help=_help("endpoints") + " Repeatable.")] = None,
    metrics_port: Annotated[int | None, typer.Option(help=_help("metrics_port"))] = None,
    metrics_host: Annotated[str | None, typer.Option(help=_help("metrics_host"))] = None,
    allow_custom_code: CustomCodeOption = None,
    cache_gb: CacheOption = None,
    sandbox_memory_gb: Annotated[float | None, typer.Option(help=_help("sandbox_memory_gb"))] = None,
    sandbox_processes: Annotated[int | None, typer.Option(help=_help("sandbox_processes"))] = None,
    step_timeout: Annotated[float | None, typer.Option(help=_help("step_timeout"))] = None,
    max_job_hours: Annotated[float | None, typer.Option(help=_help("max_job_hours"))] = None,
    warm_worker: Annotated[bool | None, typer.Option("--warm-worker/--no-warm-worker",
                                                     help=_help("warm_worker"))] = None,
    log_level: Annotated[str | None, typer.Option(help=_help("log_level"))] = None,
    log_format: Annotated[str | None, typer.Option(help=_help("log_format"))] = None,
) -> None:
    """Register with the coordinator, advertise this machine in the DHT, and train assigned jobs until SIGTERM."""
    from gpuswarm.client.api import CoordinatorClient
    from gpuswarm.node.identity import IdentityError, load_or_create

    with needs_extra("node"):
        from gpuswarm.node.daemon import NodeConfig, NodeDaemon, NodeRevoked
        from gpuswarm.node.gpu import probe
        from gpuswarm.node.meshlink import MeshUnavailable
        from gpuswarm.node.metrics import MetricsUnavailable

    settings = read_settings(config, coordinator=coordinator, state_dir=state_dir, host=host, price=price, cpu=cpu,
                             mesh=mesh, listen_port=listen_port, endpoints=endpoint, metrics_port=metrics_port,
                             metrics_host=metrics_host, allow_custom_code=allow_custom_code, cache_gb=cache_gb,
                             sandbox_memory_gb=sandbox_memory_gb, sandbox_processes=sandbox_processes,
                             step_timeout=step_timeout, max_job_hours=max_job_hours, warm_worker=warm_worker,
                             log_level=log_level, log_format=log_format)
    s = settings
    coordinator, state_dir, host, allow_custom_code = s.coordinator, s.state_dir, s.host, s.allow_custom_code
    logs.configure(s.log_level, s.log_format, "node")
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
    if missing := [f"{name} ({path})" for name, path in s.datasets.items() if not path.exists()]:
        log.error("datasets: not found: %s", ", ".join(missing))
        raise typer.Exit(1)
    limits = sandbox.Limits(memory_bytes=int(s.sandbox_memory_gb * 2**30), processes=s.sandbox_processes)
    if not s.mesh:
        log.warning("--no-mesh: hivemind traffic on %s is NOT encrypted (development only)", host)
    node_config = NodeConfig(coordinator_url=coordinator, state_dir=state_dir, host=host,
                             price_per_gpu_hour=s.price, endpoints=[host], mesh=s.mesh, mesh_listen_port=s.listen_port,
                             mesh_endpoints=s.endpoints, metrics_host=s.metrics_host, metrics_port=s.metrics_port,
                             allow_custom_code=allow_custom_code, cache_max_bytes=int(s.cache_gb * 1024**3),
                             max_job_hours=s.max_job_hours, datasets=dict(s.datasets), warm_worker=s.warm_worker,
                             sandbox=Settings(limits=limits, answer_timeout=s.step_timeout))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.set_default_executor(_AbandonedAtExit())
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with CoordinatorClient(coordinator, identity) as client:
            resources = probe(force_cpu=s.cpu).model_copy(update={"custom_code": allow_custom_code,
                                                                  "datasets": sorted(s.datasets)})
            await NodeDaemon(node_config, identity, resources, client).run(stop)

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


class _AbandonedAtExit(ThreadPoolExecutor):
    """The daemon's default executor. asyncio.run waits for its threads at exit (on Python 3.11 without a limit);
    this one is not waited for: a thread still hashing or unpacking for a step that a stop cut short is left to the
    os._exit that follows, and the node stops within its bound."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)


def read_settings(config: Path | None, **flags):
    """The node's settings (`gpuswarm.node.settings`); a bad or missing file says what and exits 2."""
    import tomllib

    from gpuswarm.node.settings import config_file, load
    from pydantic import ValidationError

    try:
        return load(config_file(config), **flags)
    except (FileNotFoundError, tomllib.TOMLDecodeError) as e:
        raise fail(f"node config: {e}", code=2) from None
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise fail(f"node config: {problems}", code=2) from None


@node_app.command("init")
def init(
    path: Annotated[Path, typer.Argument(help="Where to write it (default: /etc/gpuswarm/node.toml).")]
    = Path("/etc/gpuswarm/node.toml"),
    coordinator: CoordinatorOption = None,
    state_dir: StateDirOption = None,
    price: Annotated[float | None, typer.Option(help=_help("price"))] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
) -> None:
    """Write a commented TOML config: every setting with what it does, the ones given here set, the rest at their
    defaults (commented out). `gpuswarm node start --config PATH` reads it."""
    from gpuswarm.node.settings import render_toml

    given = {k: v for k, v in {"coordinator": coordinator, "state_dir": state_dir, "price": price}.items()
             if v is not None}
    read_settings(None, **given)  # the values must be valid settings
    if path.exists() and not force:
        raise fail(f"{path} exists; --force replaces it", code=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_toml(given))
    console.print(f"wrote {path}; start the node with: gpuswarm node start --config {path}")


@node_app.command("self-test")
def self_test(
    config: ConfigFile = None,
    coordinator: CoordinatorOption = None,
    state_dir: StateDirOption = None,
    cpu: CpuOption = None,
    mesh: MeshOption = None,
    allow_custom_code: CustomCodeOption = None,
    cache_gb: CacheOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (one object, at the end).")] = False,
) -> None:
    """Check, before this node goes live, what a renter relies on: GPUs and CUDA, the GPU challenge against its
    class's time bound, free disk, the coordinator, the mesh (WireGuard, CAP_NET_ADMIN) and the job sandbox. Each
    check prints a verdict (pass, warn, fail) as it finishes; exit status 1 when any failed. Reads the settings
    `node start` would (the same file, variables and flags)."""
    with needs_extra("node"):
        from gpuswarm.node import selftest

    settings = read_settings(config, coordinator=coordinator, state_dir=state_dir, cpu=cpu, mesh=mesh,
                             allow_custom_code=allow_custom_code, cache_gb=cache_gb)
    logging.basicConfig(level=logging.WARNING)
    colour = {"pass": "green", "warn": "yellow", "fail": "red"}

    def show(check) -> None:
        if not as_json:
            console.print(f"[{colour[check.verdict]}]{check.verdict.upper():4}[/] {check.name:12} {check.detail} "
                          f"[dim]({check.seconds:.1f}s)[/dim]", highlight=False)

    checks = selftest.run(settings, show)
    failed = [c.name for c in checks if c.verdict == "fail"]
    if as_json:
        typer.echo(json.dumps({"ok": not failed, "checks": [c.as_dict() for c in checks]}))
    else:
        console.print("ready to go live" if not failed else f"NOT READY: {', '.join(failed)} failed")
    raise typer.Exit(1 if failed else 0)


@node_app.command("status")
def status(
    config: ConfigFile = None,
    coordinator: CoordinatorOption = None,
    state_dir: StateDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """This node at a glance: its state and jobs as the coordinator sees them, its balance and earnings, the mesh,
    and its GPUs' load. Reads the settings `node start` would."""
    from gpuswarm.node.status import gather

    settings = read_settings(config, coordinator=coordinator, state_dir=state_dir)
    info = gather(settings)
    if as_json:
        typer.echo(json.dumps(info))
        raise typer.Exit(1 if "error" in info else 0)
    if "error" in info:
        raise fail(info["error"])
    c, mesh = info["coordinator"], info["mesh"]
    console.print(f"node {info['node_id']}  (state in {info['state_dir']}, coordinator {info['coordinator_url']})")
    if "error" in c:
        console.print(f"  coordinator: [red]{c['error']}[/red]")
    else:
        console.print(f"  state: {c['state']}, {'online' if c['online'] else '[red]offline[/red]'}, "
                      f"{'verified' if c['verified'] else '[yellow]not verified[/yellow]'}, reputation "
                      f"{c['reputation']:.2f}, asking {c['price_per_gpu_hour']:g}/GPU-hour")
        console.print(f"  jobs: {', '.join(c['jobs']) or 'none'}")
        earned = sum(e["earned"] for e in c["earnings"])
        console.print(f"  balance: {c['balance']:.6f} credits; earned {earned:.6f} in {len(c['earnings'])} job(s)"
                      + "".join(f"\n    {e['job_id']}: {e['earned']:.6f} for {e['compute_seconds']:.0f} s"
                                + (f" ({e['flagged']} flagged)" if e["flagged"] else "") for e in c["earnings"]))
    if "error" in mesh:
        console.print(f"  mesh: {mesh['error']}")
    else:
        paths = ", ".join(f"{n} {state}" for state, n in sorted(mesh["paths"].items()))
        console.print(f"  mesh: {mesh['interface']} {mesh['address']}, {mesh['peers']} peer(s)"
                      + (f" ({paths})" if paths else ""))
    gpus = info["gpus"]
    console.print("  gpus: " + (", ".join(f"#{g['index']} {g['utilization']:.0%} busy, {g['memory_used_gb']:.1f} of "
                                          f"{g['memory_total_gb']:.0f} GiB" for g in gpus) or "none read (no NVML)"))


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
