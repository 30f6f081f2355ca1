"""The job owner's sweep commands, `gpuswarm sweep ...`: submit, status (--follow), cancel and download, each a
client of the coordinator's sweep routes (coordinator/views/sweeps.py).

The sweep file is TOML: the `SweepSpec`'s own keys (name, metric, direction, trials, parallel, seed, and the tables
[space.NAME], [sampler], [pruner]) and the job every trial runs, as `job = "job.toml"` (a job file, relative to the
sweep file) or as an inline [job] table in the job file's format. `submit` packs and uploads the job's code and
dataset like `gpuswarm job submit` (once: every trial runs the same blobs) and checks the whole sweep before
anything is sent.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from gpuswarm.client.api import SyncClient
from gpuswarm.client.common import DEFAULT_URL, CoordinatorURL, JsonFlag, OwnerToken, ago, call, fmt
from gpuswarm.client.jobcli import job_download, job_of, upload_missing
from gpuswarm.proto.api import dump
from gpuswarm.proto.strict import error_details
from gpuswarm.proto.sweeps import SweepDetail, SweepSpec, SweepState, TrialState
from pydantic import ValidationError
from rich.markup import escape

from gpuswarm.console import Col, console, err, fail, fit_table, print_json, print_listing

sweep_app = typer.Typer(help="Hyper-parameter sweeps: many trials of a job, the best one kept.", no_args_is_help=True)

SWEEP_COLUMNS = [Col("ID", 14, 14), Col("NAME", 8, 32), Col("STATE", 9, 9), Col("METRIC", 8, 20),
                 Col("TRIALS", 6, 9, justify="right"), Col("BEST", 6, 8, justify="right"),
                 Col("SUBMITTED", 9, 9, drop=1)]
TRIAL_COLUMNS = [Col("#", 2, 4, justify="right"), Col("STATE", 9, 9), Col("VALUE", 6, 8, justify="right"),
                 Col("STEP", 4, 8, justify="right"), Col("PARAMS", 20, 80), Col("JOB", 14, 14, drop=1)]


def read_sweep(file: Path, local_check: bool) -> tuple[SweepSpec, Any]:
    """The sweep file's spec and its built job (packed, not yet uploaded); a bad file exits 1 saying why."""
    from gpuswarm.client.jobfile import JobFileError, expand_path, read_job_file

    try:
        table = read_job_file(file)
    except JobFileError as e:
        raise fail(str(e)) from None
    job = table.pop("job", None)
    if isinstance(job, str):
        built = job_of(expand_path(job, file.parent), {}, [], local_check)
    elif isinstance(job, dict):
        built = job_of(file, {}, [], local_check, table=job)
    else:
        raise fail(f"{file}: `job` names the job every trial runs: a job file (job = \"job.toml\") or a [job] table")
    try:
        spec = SweepSpec.model_validate(table | {"job": built.spec.model_dump(mode="json")})
    except ValidationError as e:
        lines = "\n".join(f"  {d['field']}: {d['message']}" for d in error_details(e))
        raise fail(f"invalid sweep {file}:\n{lines}") from None
    return spec, built


@sweep_app.command("submit")
def sweep_submit(
    file: Annotated[Path, typer.Argument(help="Sweep spec as TOML.")],
    no_local_check: Annotated[bool, typer.Option("--no-local-check", help="Do not import your code here to check "
                                                                          "its params.")] = False,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Submit a sweep: check it, upload the job's code and dataset the coordinator lacks, start its trials."""
    spec, built = read_sweep(file, not no_local_check)
    client = SyncClient(coordinator, token=token)
    upload_missing(client, built)
    sweep = call(client.submit_sweep, spec)
    if as_json:
        return print_json(dump(sweep))
    console.print(escape(f"submitted {sweep.id}: {spec.trials} trials of {spec.job.label} ({spec.parallel} at a "
                         f"time, up to {spec.budget:g} credits), {spec.direction} {spec.metric}; follow it with: "
                         f"gpuswarm sweep status {sweep.id} --follow"))


@sweep_app.command("status")
def sweep_status(
    sweep_id: Annotated[str | None, typer.Argument(help="Sweep ID (none: list your sweeps).")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Print again as trials end, until the sweep "
                                                                "does.")] = False,
    interval: Annotated[float, typer.Option(min=0.5, help="Seconds between polls with --follow.")] = 3.0,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """A sweep's trials (values, state, metric) and the best so far; without an ID, your sweeps."""
    client = SyncClient(coordinator, token=token)
    if sweep_id is None:
        return list_sweeps(client, as_json)
    shown = None
    while True:
        sweep = call(client.sweep, sweep_id)
        seen = [(t.number, t.state) for t in sweep.trials]
        if seen != shown:
            shown = seen
            print_json(dump(sweep)) if as_json else print_sweep(sweep)
        if not follow or sweep.state != SweepState.RUNNING:
            return
        time.sleep(interval)


def list_sweeps(client: SyncClient, as_json: bool) -> None:
    sweeps = call(client.sweeps)
    if as_json:
        return print_json(dump(sweeps))
    if not sweeps:
        return console.print("no sweeps")
    rows = [[s.id, s.name or "-", s.state.value, f"{s.direction[:3]} {s.metric}", f"{s.trials_done}/{s.trials}",
             fmt(s.best_value), ago(s.created_at)] for s in sweeps]
    print_listing(*fit_table(SWEEP_COLUMNS, rows, console.width), f"{len(sweeps)} sweep{'s' * (len(sweeps) != 1)}")


def print_sweep(sweep: SweepDetail) -> None:
    rows = []
    for t in sweep.trials:
        step = t.pruned_at_step if t.pruned_at_step is not None else (t.curve[-1][0] if t.curve else None)
        value = t.value if t.value is not None else (t.curve[-1][1] if t.curve else None)
        mark = "*" if t.number == sweep.best_trial else ""
        rows.append([f"{mark}{t.number}", t.state.value, fmt(value), "-" if step is None else str(step),
                     json.dumps(t.params, separators=(",", ":")), t.job_id or "-"])
    counts = {s.value: sum(t.state == s for t in sweep.trials) for s in TrialState}
    summary = (f"{sweep.id} {sweep.state.value}: {len(sweep.trials)}/{sweep.trials_planned} trials started ("
               + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f"); {sweep.direction} {sweep.metric}")
    if sweep.best is not None:
        summary += (f"; best: trial {sweep.best.number} = {fmt(sweep.best.value)} (job {sweep.best.job_id}; "
                    f"download it with: gpuswarm sweep download {sweep.id})")
    if sweep.reason:
        summary += f"; {sweep.reason}"
    print_listing(*fit_table(TRIAL_COLUMNS, rows, console.width), escape(summary))


@sweep_app.command("cancel")
def sweep_cancel(sweep_id: str, coordinator: CoordinatorURL = DEFAULT_URL, token: OwnerToken = None,
                 as_json: JsonFlag = False) -> None:
    """Cancel a sweep and its running trials (their jobs stop within a heartbeat)."""
    sweep = call(SyncClient(coordinator, token=token).cancel_sweep, sweep_id)
    print_json(dump(sweep)) if as_json else console.print(f"{sweep.id} cancelled")


@sweep_app.command("download")
def sweep_download(
    sweep_id: str,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Where to save it.")] = None,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Download the best trial's final model (the same as `gpuswarm job download` of its job)."""
    sweep = call(SyncClient(coordinator, token=token).sweep, sweep_id)
    if sweep.best is None:
        raise fail(f"sweep {sweep_id} has no completed trial yet (state: {sweep.state.value})")
    if not as_json:
        err.print(escape(f"the best trial is {sweep.best.number} ({sweep.metric} {fmt(sweep.best.value)}, "
                         f"{json.dumps(sweep.best.params)}): job {sweep.best.job_id}"), soft_wrap=True)
    job_download(sweep.best.job_id, output=output, name=None, checkpoint=None, tensorboard=None,
                 coordinator=coordinator, token=token, as_json=as_json)
