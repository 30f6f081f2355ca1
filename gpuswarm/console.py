"""The command line's shared output helpers: the consoles, errors that exit, JSON output, fitted tables, and the
message for a command whose install extra is missing.

A leaf module: it imports no gpuswarm package, so every package's CLI module (proto's log options aside, the one
place these are written) may use it, as every package already uses `gpuswarm.__version__`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import typer
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

# Piped output (scripts, CI logs) is not cut to 80 columns; a terminal keeps its own width, and COLUMNS wins.
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else 160)
err = Console(stderr=True)

# The modules only one install extra brings (pyproject.toml's optional-dependencies), by top-level import name. Those
# both bring (hivemind, numpy, prometheus_client) are not here: a command missing one names its own extra.
EXTRA_OF_MODULE = {
    "torch": "node", "sklearn": "node", "pyroute2": "node",
    "tensorboardX": "coordinator", "sqlalchemy": "coordinator", "alembic": "coordinator", "aiosqlite": "coordinator",
}


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` to stderr and return the Exit to raise (`raise fail(...)`)."""
    err.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(code)


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=True))


@contextlib.contextmanager
def needs_extra(extra: str) -> Iterator[None]:
    """Imports inside this block that fail because an install extra is missing exit with the extra to install:
    `with needs_extra("node"): from gpuswarm.node.daemon import run`."""
    try:
        yield
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top.startswith("gpuswarm") or not top:
            raise
        wanted = EXTRA_OF_MODULE.get(top, extra)
        raise fail(f"this command needs {top}, which the gpuswarm[{wanted}] install brings: "
                   f"pip install 'gpuswarm[{wanted}]'") from None


@dataclass(frozen=True)
class Col:
    """A column of a listing that keeps every row on one line, however many rows there are.

    Values longer than `max` end in an ellipsis. When the terminal is too narrow, the columns with the most room
    shrink toward `min` (an ID column: min == max, whole or not at all); if that is not enough, columns are left
    out, the highest `drop` first (0: never)."""

    header: str
    min: int
    max: int
    drop: int = 0
    justify: str = "left"


COLUMN_GAP = 2  # padding (0, 1) without edges: one space on each side of the line between two columns


def fit_table(columns: list[Col], rows: list[list[str]], width: int) -> tuple[Table, list[str]]:
    """A borderless table of `rows` no wider than `width`, and the headers of the columns left out to fit."""
    natural = [min(c.max, max(cell_len(v) for v in [c.header, *(r[i] for r in rows)])) for i, c in enumerate(columns)]
    floor = [min(n, c.min) for n, c in zip(natural, columns, strict=True)]
    keep = list(range(len(columns)))
    while True:
        widths = {i: natural[i] for i in keep}
        excess = sum(widths.values()) + COLUMN_GAP * (len(keep) - 1) - width
        while excess > 0:
            roomy = max(keep, key=lambda i: widths[i] - floor[i])
            if widths[roomy] <= floor[roomy]:
                break
            widths[roomy] -= 1
            excess -= 1
        droppable = [i for i in keep if columns[i].drop]
        if excess <= 0 or not droppable:
            break
        keep.remove(max(droppable, key=lambda i: columns[i].drop))
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
    for i in keep:
        table.add_column(columns[i].header, width=widths[i], no_wrap=True, overflow="ellipsis",
                         justify=columns[i].justify)
    for row in rows:
        table.add_row(*(Text(row[i]) for i in keep))  # Text: a name with [brackets] is not markup
    return table, [c.header for i, c in enumerate(columns) if i not in keep]


def print_listing(table: Table, hidden: list[str], summary: str) -> None:
    console.print(table)
    console.print(Text(summary))
    if hidden:
        console.print(Text(f"hidden to fit {console.width} columns: {', '.join(hidden)} (a wider terminal or "
                           f"--json shows them)"), style="dim")
