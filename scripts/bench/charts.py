"""Pictures for docs/benchmarks.md: each bench command draws its table as a PNG under docs/img and puts the image
line beside the table it appends. Owns only drawing (matplotlib, headless); the figures come from the caller.

Two shapes cover the tables: grouped bars (one group per case, one bar per series, an optional reference line
such as a goal) and lines (a measure against a count, optionally with the ideal line, such as linear speedup).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "img"


def _save(fig, name: str, title: str) -> str:
    """Write docs/img/NAME.png and return the Markdown line that shows it from docs/benchmarks.md."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(IMAGES / f"{name}.png", dpi=110)
    plt.close(fig)
    return f"![{title}](img/{name}.png)"


def bars(name: str, title: str, groups: Sequence[str], series: dict[str, Sequence[float]], ylabel: str,
         reference: tuple[float, str] | None = None, log: bool = False) -> str:
    """Grouped bars: `series` maps a label to one value per group. `reference` draws a dashed line (value, label)."""
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) + 2), 3.6))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width, label=label)
    if reference is not None:
        ax.axhline(reference[0], color="black", linestyle="--", linewidth=1, label=reference[1])
    ax.set_xticks(range(len(groups)), groups, rotation=30 if max(map(len, groups), default=0) > 10 else 0,
                  ha="right" if max(map(len, groups), default=0) > 10 else "center", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, name, title)


def lines(name: str, title: str, x: Sequence[float], series: dict[str, Sequence[float]], xlabel: str, ylabel: str,
          ideal: Sequence[float] | None = None) -> str:
    """One line per series against x; `ideal` (one value per x) is drawn dashed, e.g. linear speedup."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, values in series.items():
        ax.plot(x, values, marker="o", label=label)
    if ideal is not None:
        ax.plot(x, ideal, linestyle="--", color="gray", label="ideal")
    ax.set_xticks(list(x))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, name, title)
