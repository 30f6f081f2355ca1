"""The log formats every gpuswarm process shares: human text or one JSON object per line.

Owns the daemons' --log-level/--log-format options, `configure` (levels, the format, and routing hivemind's own
logger through ours) and `JsonFormatter`. The JSON shape is stable for log shippers (Loki, Vector,
Elasticsearch): `ts` (RFC 3339, UTC), `level`, `logger`, `msg`, `pid`, `process` (coordinator, node, worker),
then `exc` when an exception is attached, then whatever the call passed in `extra={...}`.
"""

from __future__ import annotations

import datetime
import enum
import json
import logging
import os
import sys
from typing import Annotated

import typer

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
FORMAT_ENV = "GPUSWARM_LOG_FORMAT"  # child processes (a node's training worker) log in their parent's format
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
Level = enum.StrEnum("Level", {name: name for name in LEVELS})
Format = enum.StrEnum("Format", {name: name for name in FORMATS})
# The daemons' --log-level and --log-format options.
LogLevel = Annotated[Level, typer.Option(case_sensitive=False, help="Least severe level logged.")]
LogFormat = Annotated[Format, typer.Option(help="text: for people; json: one object per line (ts, level, logger, "
                                           "msg, pid, process, exc).")]
# By number: hivemind renames WARNING to "WARN".
_LEVEL_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error",
                logging.CRITICAL: "critical"}
# Attributes every LogRecord has: anything else on a record came from `extra=` and is emitted as a field.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": _LEVEL_NAMES.get(record.levelno, record.levelname.lower()),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
            "process": self.process,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure(level: str, fmt: str, process: str) -> None:
    """Set up the root logger for a daemon: `level` one of LEVELS, `fmt` one of FORMATS. With `json`, hivemind's
    loggers (which have their own coloured handler) propagate to ours instead, so that every line is JSON."""
    level, fmt = str(level).lower(), str(fmt)
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    os.environ[FORMAT_ENV] = fmt
    if fmt != "json":
        return
    try:
        from hivemind.utils.logging import use_hivemind_log_handler
    except ImportError:  # pragma: no cover - hivemind is a dependency; this keeps proto importable without it
        return
    use_hivemind_log_handler("nowhere")
