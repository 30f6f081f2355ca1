"""What the API's command modules share: their option types, the call wrapper that turns an API error into a CLI
error, the admin token, and the formats of times and numbers in listings.

Used by the job owner's commands (client/jobcli.py, client/follow.py), the node listing (client/nodescli.py) and
the operator's `coordinator credit` (coordinator/cli.py). No command lives here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from gpuswarm.client.api import DEFAULT_URL, ApiError

from gpuswarm.console import fail

T = TypeVar("T")

CoordinatorURL = Annotated[str, typer.Option("--coordinator", "-c", envvar="GPUSWARM_COORDINATOR",
                                             help="Coordinator base URL; several, comma-separated, to fail over "
                                                  "between the coordinators of one database.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
OwnerToken = Annotated[str | None, typer.Option("--token", envvar="GPUSWARM_TOKEN",
                                                help="Your API token (gso_...), from `coordinator create-owner`.")]
AdminToken = Annotated[str | None, typer.Option("--admin-token", envvar="GPUSWARM_ADMIN_TOKEN",
                                                help="Admin token (default: read from --data-dir).")]
DataDir = Annotated[Path, typer.Option(help="Coordinator data dir (database, admin.token).")]

__all__ = ["DEFAULT_URL", "AdminToken", "CoordinatorURL", "DataDir", "JsonFlag", "OwnerToken", "admin", "ago",
           "call", "counted", "fmt"]


def call(fn: Callable[..., T], *args) -> T:
    """`fn(*args)`, an API call; its ApiError becomes `error: MESSAGE` and exit 1."""
    try:
        return fn(*args)
    except ApiError as e:
        raise fail(e.message) from None


def admin(token: str | None, data_dir: Path) -> str:
    """The admin token: given, or read from the coordinator's data dir."""
    if token:
        return token
    try:
        return (data_dir / "admin.token").read_text().strip()
    except OSError as e:
        raise fail(f"no --admin-token given and cannot read {data_dir / 'admin.token'}: {e.strerror}") from None


def ago(t: float | None) -> str:
    if not t:
        return "-"
    seconds = max(0.0, time.time() - t)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago" if seconds < 7200 else \
        f"{seconds / 3600:.0f}h ago"


def fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def counted(counts: dict[str, int], order: list[str]) -> str:
    return ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))
