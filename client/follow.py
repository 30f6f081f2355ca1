"""`gpuswarm job status JOB --follow`: poll a job until it ends, as a live display on a terminal or one plain line
per change in a pipe, and the exit code that says how it ended; and a job's log (`job logs`, with --follow).

Owns the follow loop (retrying while the coordinator is unreachable, up to --timeout), the progress toward the job's
stop rule, both renderings, and `log_records` (the job's events, with node failures' full reasons). The commands
and their options are client/jobcli.py's.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any

import typer
from gpuswarm.client.api import ApiError, Rejected, SyncClient
from gpuswarm.client.common import fmt
from gpuswarm.proto.api import JobDetail
from gpuswarm.proto.models import JobState
from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gpuswarm import ctrl_c
from gpuswarm.console import console, err

EXIT_UNREACHABLE = 3
FOLLOW_EVENTS = 5  # events already there when following starts that are shown; later ones all are


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else \
        f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"


TARGET = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_./-]*)\s*(<=|>=)\s*(\S+)\s*$")  # proto.models.TARGET_PATTERN


def toward_stop(job: JobDetail) -> tuple[float | None, str]:
    """How far the job is toward its stop rule, 0..1 (None: nothing to measure yet), and what that is measured by.

    Training stops at whichever rule is met first, so with several rules the nearest one counts."""
    stop, p = job.spec.stop, job.progress
    fractions, parts = [], []
    if stop.max_epochs and (p.epoch or job.spec.workload is not None):  # owners' code may not know its epochs
        fractions.append(p.epoch / stop.max_epochs)
        parts.append(f"epoch {p.epoch:.2f}/{stop.max_epochs}")
    if stop.max_steps:
        fractions.append(p.global_step / stop.max_steps)
        parts.append(f"step {p.global_step}/{stop.max_steps}")
    if stop.max_seconds and job.started_at:
        fractions.append(((job.finished_at or time.time()) - job.started_at) / stop.max_seconds)
        parts.append(f"time {elapsed(job)}/{duration(stop.max_seconds)}")
    metrics = {**p.metrics, **({"accuracy": p.accuracy} if p.accuracy is not None else {})}
    for name, op, threshold in metric_rules(job):
        value = metrics.get(name)
        if value is not None:
            fraction = value / threshold if op == ">=" else threshold / value if value > 0 else 1.0
            fractions.append(max(0.0, fraction))
        parts.append(f"{name} {fmt(value)} {op} {threshold:g}")
    fraction = 1.0 if job.state == JobState.COMPLETED else min(1.0, max(fractions)) if fractions else None
    return fraction, " or ".join(parts)


def metric_rules(job: JobDetail) -> list[tuple[str, str, float]]:
    """The stop rules on metrics as (name, "<=" or ">=", threshold); a target this version cannot read is left out."""
    stop, rules = job.spec.stop, []
    if stop.target and (match := TARGET.match(stop.target)):
        with contextlib.suppress(ValueError):
            rules.append((match.group(1), match.group(2), float(match.group(3))))
    if stop.target_accuracy:
        rules.append(("accuracy", ">=", stop.target_accuracy))
    return rules


def follow_facts(job: JobDetail) -> list[tuple[str, str]]:
    """The numbers a follower watches, as (label, value), in display order; elapsed time is left to the caller."""
    p = job.progress
    facts = [("step", str(p.global_step))]
    if job.contributions:  # peer-attested samples; the job itself keeps no sample count
        facts.append(("samples credited", str(sum(c.samples for c in job.contributions))))
    facts += [("samples/s", f"{p.samples_per_second:.0f}"), ("accuracy", fmt(p.accuracy)),
              ("loss", fmt(p.loss))]
    facts += [(name, f"{value:.4g}") for name, value in sorted(p.metrics.items()) if name not in ("accuracy", "loss")]
    facts += [("peers", str(p.peers)),
              ("nodes", str(sum(a.state == "active" for a in job.assignments)))]
    return facts


def elapsed(job: JobDetail) -> str:
    start = job.started_at or job.created_at
    return duration((job.finished_at or time.time()) - start)


def plain_progress(job: JobDetail) -> str:
    """One line of progress for logs and pipes; the same job gives the same line (no clock in it)."""
    fraction, measure = toward_stop(job)
    percent = "" if fraction is None else f" {fraction:.0%}"
    facts = "  ".join(f"{label} {value}" for label, value in follow_facts(job))
    return f"{job.state}{percent}  {measure}  {facts}"


class FollowView:
    """The live display of `job status --follow` on a terminal; re-rendered on each refresh so elapsed time ticks."""

    def __init__(self) -> None:
        self.job: JobDetail | None = None
        self.warning: str | None = None

    def __rich__(self) -> Group:
        lines: list[Any] = []
        if self.job is not None:
            job = self.job
            fraction, measure = toward_stop(job)
            lines.append(Text.assemble((job.id, "bold"), f" {job.name}  ", ("state ", "dim"),
                                       (job.state.value, "bold"), ("  workload ", "dim"), job.spec.label,
                                       ("  elapsed ", "dim"), elapsed(job)))
            bar = Table.grid(padding=(0, 1))
            bar.add_row(ProgressBar(total=None if fraction is None else 1.0, completed=fraction or 0.0, width=40),
                        Text("   " if fraction is None else f"{fraction:4.0%}"), Text(measure))
            lines.append(bar)
            facts = Text()
            for label, value in follow_facts(job):
                facts.append(f"{label} ", "dim").append(f"{value}  ")
            lines.append(facts)
        if self.warning:
            lines.append(Text(self.warning, "yellow"))
        return Group(*lines)


class StopFollowing(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def follow_job(client: SyncClient, job_id: str, interval: float, timeout: float | None, as_json: bool) -> int:
    """Poll the job until it ends and return the exit code; Ctrl-C stops following (130), not the job."""
    view = FollowView()
    live = console.is_terminal and not as_json
    ctrl_c.take_ctrl_c()  # Ctrl-C raises only between polls, never inside the client's event loop
    try:
        with Live(view, console=console, refresh_per_second=4) if live else contextlib.nullcontext():
            job = poll_until_final(client, job_id, interval, timeout, as_json, view if live else None)
    except KeyboardInterrupt:
        err.print("stopped following; the job keeps running")
        return 130
    except StopFollowing as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        return e.code
    if not as_json:
        typer.echo(f"job {job.id} {job.state}: final accuracy {fmt(job.final_accuracy)}"
                   + (f"; error: {job.error}" if job.error else ""))
    return 0 if job.state == JobState.COMPLETED else 1


def poll_until_final(client: SyncClient, job_id: str, interval: float, timeout: float | None,
                     as_json: bool, view: FollowView | None) -> JobDetail:
    """The follow loop: `view` is the live display, or None for plain lines. Returns the job in its final state.

    A coordinator that cannot be reached (or answers 5xx) is retried every `interval` with a warning, until
    `timeout` seconds of it; a 4xx (unknown job, bad token) ends at once, as retrying cannot help."""
    seen_events: set[tuple[float, str]] = set()
    last_line, down_since, first = None, None, True
    while True:
        try:
            job = client.job(job_id)
            ctrl_c.interrupted()
        except ApiError as e:
            if isinstance(e, Rejected):
                raise StopFollowing(1, e.message) from None
            now = time.monotonic()
            if down_since is None:
                down_since = now
                if view is None:
                    err.print(f"[yellow]warning:[/yellow] {escape(e.message)}; retrying every {interval:g}s",
                              soft_wrap=True)
            if view is not None:
                view.warning = f"{e.message}; retrying every {interval:g}s (for {duration(now - down_since)})"
            if timeout is not None and now - down_since >= timeout:
                raise StopFollowing(EXIT_UNREACHABLE,
                                    f"gave up: the coordinator was unreachable for {timeout:g}s") from None
            ctrl_c.interrupted(wait=interval)
            continue
        if down_since is not None:
            down_since = None
            if view is None:
                err.print("coordinator reachable again")
            else:
                view.warning = None
        new_events = [e for e in job.events if (e.at, e.message) not in seen_events]
        if first:
            new_events, first = new_events[-FOLLOW_EVENTS:], False
        seen_events.update((e.at, e.message) for e in job.events)
        if as_json:
            typer.echo(json.dumps(job.model_dump(mode="json"), sort_keys=True))
        elif view is not None:
            for e in new_events:  # printed above the live display, where they stay
                console.print(Text.assemble((clock(e.at), "dim"), f" {e.message}"))
            view.job = job
        else:
            for e in new_events:
                typer.echo(f"{clock(e.at)} event: {e.message}")
            line = plain_progress(job)
            if line != last_line:
                typer.echo(f"{clock(time.time())} {line}  elapsed {elapsed(job)}")
                last_line = line
        if job.state.is_final:
            return job
        ctrl_c.interrupted(wait=interval)


# ---------------------------------------------------------------------------------------------------- job logs


def log_records(job: JobDetail) -> list[tuple[float, str]]:
    """The job's events as (time, message), oldest first, a node failure's message with its full reason (events
    keep only the end of it; the assignment keeps it all), and the job's error when it failed."""
    full = {(a.ended_at, a.node_id): a.reason for a in job.assignments if a.reason and a.ended_at is not None}
    records = []
    for e in job.events:
        match = re.match(r"^node ([0-9a-f]{16}) failed: ", e.message)
        reason = full.get((e.at, match.group(1))) if match else None
        records.append((e.at, f"node {match.group(1)} failed: {reason}" if reason else e.message))
    if job.error and job.finished_at and not any(job.error in message for _, message in records):
        records.append((job.finished_at, f"error: {job.error}"))
    return sorted(records, key=lambda r: r[0])


def follow_logs(client: SyncClient, job_id: str, interval: float, as_json: bool) -> int:
    """Print the job's log, then each new record as it comes, until the job ends: exit 0 when it completed, 1
    otherwise, 130 on Ctrl-C. A coordinator that cannot be reached is retried every `interval`."""
    ctrl_c.take_ctrl_c()
    seen: set[tuple[float, str]] = set()
    warned = False
    try:
        while True:
            try:
                job = client.job(job_id)
            except ApiError as e:
                if isinstance(e, Rejected):
                    err.print(f"[red]error:[/red] {escape(e.message)}")
                    return 1
                if not warned:
                    err.print(f"[yellow]warning:[/yellow] {escape(e.message)}; retrying every {interval:g}s")
                    warned = True
                ctrl_c.interrupted(wait=interval)
                continue
            warned = False
            for record in log_records(job):
                if record not in seen:
                    seen.add(record)
                    at, message = record
                    typer.echo(json.dumps({"at": at, "message": message}) if as_json else f"{clock(at)} {message}")
            if job.state.is_final:
                return 0 if job.state == JobState.COMPLETED else 1
            ctrl_c.interrupted(wait=interval)
    except KeyboardInterrupt:
        err.print("stopped following; the job keeps running")
        return 130
