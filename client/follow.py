"""`gpuswarm job status JOB --follow`: poll a job until it ends, as a live display on a terminal or one plain line
per change in a pipe, and the exit code that says how it ended.

Owns the follow loop (retrying while the coordinator is unreachable, up to --timeout), the progress toward the job's
stop rule, and both renderings. The command itself and its options are client/jobcli.py's.
"""

from __future__ import annotations

import contextlib
import json
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


def toward_stop(job: JobDetail) -> tuple[float | None, str]:
    """How far the job is toward its stop rule, 0..1 (None: nothing to measure yet), and what that is measured by.

    Training stops at whichever rule is met first, so with both rules the nearer one counts."""
    stop, p = job.spec.stop, job.progress
    fractions, parts = [], []
    if stop.max_epochs:
        fractions.append(p.epoch / stop.max_epochs)
        parts.append(f"epoch {p.epoch:.2f}/{stop.max_epochs}")
    if stop.target_accuracy:
        if p.accuracy is not None:
            fractions.append(p.accuracy / stop.target_accuracy)
        parts.append(f"accuracy {fmt(p.accuracy)}/{stop.target_accuracy}")
    fraction = 1.0 if job.state == JobState.COMPLETED else min(1.0, max(fractions)) if fractions else None
    return fraction, " or ".join(parts)


def follow_facts(job: JobDetail) -> list[tuple[str, str]]:
    """The numbers a follower watches, as (label, value), in display order; elapsed time is left to the caller."""
    p = job.progress
    facts = [("step", str(p.global_step))]
    if job.contributions:  # peer-attested samples; the job itself keeps no sample count
        facts.append(("samples credited", str(sum(c.samples for c in job.contributions))))
    facts += [("samples/s", f"{p.samples_per_second:.0f}"), ("accuracy", fmt(p.accuracy)),
              ("loss", fmt(p.loss)), ("peers", str(p.peers)),
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
                                       (job.state.value, "bold"), ("  workload ", "dim"), job.spec.workload,
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
