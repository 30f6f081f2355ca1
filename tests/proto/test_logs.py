"""Structured logs: the JSON formatter's fields, and both daemons writing nothing but JSON with --log-format json."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from gpuswarm.proto.logs import JsonFormatter, configure
from localswarm import LocalSwarm


def record(level: int, msg: str, *args, exc_info=None, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("gpuswarm.test", level, __file__, 1, msg, args, exc_info)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_json_lines_carry_level_logger_message_and_extra_fields():
    line = JsonFormatter("node").format(record(logging.WARNING, "job %s lost", "j-1", job_id="j-1", peers=3))
    entry = json.loads(line)
    assert entry["level"] == "warning" and entry["logger"] == "gpuswarm.test" and entry["msg"] == "job j-1 lost"
    assert entry["process"] == "node" and entry["job_id"] == "j-1" and entry["peers"] == 3
    assert entry["ts"].endswith("+00:00") and "exc" not in entry


def test_json_lines_carry_the_exception_and_normalise_hivemind_level_names():
    try:
        raise ValueError("bad tensor")
    except ValueError:
        rec = record(logging.ERROR, "failed", exc_info=sys.exc_info())
    entry = json.loads(JsonFormatter("worker").format(rec))
    assert "ValueError: bad tensor" in entry["exc"] and "\n" not in json.dumps(entry).strip("\n")
    renamed = record(logging.WARNING, "x")
    renamed.levelname = "WARN"  # what hivemind calls it
    assert json.loads(JsonFormatter("node").format(renamed))["level"] == "warning"


def test_unknown_level_or_format_is_refused():
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        configure("info", "xml", "node")
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        configure("loud", "json", "node")


def test_bad_log_format_option_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "gpuswarm.cli", "coordinator", "serve", "--log-format", "xml"],
                            capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert result.returncode == 2 and "'xml' is not one of 'text', 'json'" in result.stderr


def test_coordinator_and_node_write_only_json_lines(tmp_path):
    with LocalSwarm(tmp_path) as lab:
        lab.start_coordinator("--log-format", "json")
        lab.start_node(0, 0.5, "--log-format", "json")
        lab.wait_for_nodes(1)
    for name, process in (("coordinator", "coordinator"), ("node-0", "node")):
        lines = (lab.logs / f"{name}.log").read_text().splitlines()
        entries = [json.loads(line) for line in lines]  # every line, hivemind's and the p2p daemon's included
        assert entries and {e["process"] for e in entries} == {process}
        assert {"ts", "level", "logger", "msg", "pid"} <= set(entries[0])
    messages = " ".join(e["msg"] for e in entries)
    assert "registered" in messages, messages[:2000]
