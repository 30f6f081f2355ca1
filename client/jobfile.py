"""The job file: a TOML job spec, merged with the command line's flags and `--param NAME=VALUE` pairs, and checked.

Owns `build_spec`, the one path from a job file to a `JobSpec` (both `gpuswarm job submit` and the offline
`gpuswarm job validate` use it), and `JobFileError`, its only exception, whose message says what is wrong: the
file that cannot be read, the TOML line that does not parse, or every invalid key by its full path, in the words
the coordinator's 422 answers use (`proto.strict.error_details`). The checks are the coordinator's own (the
strict `proto.models.JobSpec`), so a file that passes here is refused there only for reasons this side cannot
know: the owner's balance, a workload this coordinator does not run. No network, no printing, no exiting: the
CLI (client/jobcli.py) decides what to show.
"""

from __future__ import annotations

import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from gpuswarm.proto.models import JobSpec
from gpuswarm.proto.strict import error_details
from gpuswarm.proto.workloads import WORKLOADS
from pydantic import ValidationError

_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


class JobFileError(ValueError):
    """A job file, flag or --param that does not make a valid job spec; the message says which key and why."""


def build_spec(file: Path | None, overrides: dict[str, Any], params: list[str]) -> JobSpec:
    """The job spec of `file` (TOML; None: flags only) with `overrides` applied and `params` as hyper-parameters.

    `overrides` maps a key path ("budget", "stop.max_epochs") to a value; None values are flags not given and
    leave the file's value alone. `params` are "NAME=VALUE" strings from --param: each value is read as the type
    the workload's schema gives NAME (so "64" is an int for an int parameter), else as JSON, else as text."""
    spec = read_job_file(file) if file is not None else {}
    for key, value in overrides.items():
        if value is not None:
            _set(spec, key, value)
    schema = WORKLOADS.get(spec.get("workload")) if isinstance(spec.get("workload"), str) else None
    for item in params:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise JobFileError(f"--param takes NAME=VALUE, got {item!r}")
        _set(spec, f"hyperparameters.{name}", param_value(schema, name, raw))
    try:
        return JobSpec.model_validate(spec)
    except ValidationError as e:
        where = f" in {file}" if file is not None else ""
        problems = "\n".join(f"  {d['field'] or 'job spec'}: {d['message']}" for d in error_details(e))
        raise JobFileError(f"invalid job spec{where}:\n{problems}") from None


def read_job_file(file: Path) -> dict[str, Any]:
    """The TOML table of `file`; a file that cannot be read or parsed is a JobFileError naming it (and the line)."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise JobFileError(f"cannot read job file {file}: {e}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message ends "(at line 3, column 9)"
        raise JobFileError(f"job file {file} is not valid TOML: {e}") from None


def _set(spec: dict[str, Any], path: str, value: Any) -> None:
    section, _, key = path.partition(".")
    if not key:
        spec[section] = value
        return
    table = spec.setdefault(section, {})
    if not isinstance(table, dict):
        raise JobFileError(f"{section}: must be a table to set {path}, got {type(table).__name__} {table!r}")
    table[key] = value


def param_value(schema: Any, name: str, raw: str) -> Any:
    """A --param value as the type `schema` (a workload's hyper-parameter model, or None) declares for `name`.

    A value that does not read as that type is passed on as text, so the strict check names the parameter."""
    field = schema.model_fields.get(name) if schema is not None else None
    kind = _scalar_type(field.annotation) if field is not None else None
    text = raw.strip()
    try:
        if kind is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            return raw
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is str:
            return raw
    except ValueError:
        return raw
    try:  # an unknown name (the strict check names it) or a structured type: JSON, as before, else text
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _scalar_type(annotation: Any) -> type | None:
    """bool, int, float or str for an annotation that is one of them (or it `| None`); None otherwise."""
    if annotation in (bool, int, float, str):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = {_scalar_type(arg) for arg in typing.get_args(annotation) if arg is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    return None
