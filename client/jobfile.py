"""The job file: a TOML job spec, merged with the command line's flags and `--param NAME=VALUE` pairs, and checked;
then the owner's code and dataset packed (client/pack.py), and the wire spec made with their hashes.

Owns `build_job` / `build_spec`, the one path from a job file to a `JobSpec` (both `gpuswarm job submit` and the
offline `gpuswarm job validate` use it), in three steps: `read_job` (TOML + flags into a `JobFile`, every key
checked, nothing packed yet), `pack_job` (the [code] directory or wheel and the [dataset] file or directory as
`Pack`s), `make_spec` (the `JobSpec` with `CodeRef`/`DatasetRef` filled in from the packs). Between the last two,
`check_params` runs the owner's own params schema in a child process (`python -m gpuswarm.sdk.loader`), so that the
CLI never imports the owner's code itself.

`JobFileError` is its only exception, whose message says what is wrong: the file that cannot be read, the TOML line
that does not parse, every invalid key by its full path (in the words the coordinator's 422 answers use,
`proto.strict.error_details`), a path that does not exist, a bad param as the code's schema says. The checks are the
coordinator's own (the strict `proto.models.JobSpec`), so a file that passes here is refused there only for reasons
this side cannot know: the owner's balance or quota, a workload this coordinator does not run. No network, no
printing, no exiting: the CLI (client/jobcli.py) decides what to show.

The job file's own keys, beyond the JobSpec's (paths are relative to the job file's directory):

    [code]      path (a directory or a .whl), entrypoint ("pkg.mod:func"), exclude (globs)
    [dataset]   path (a file or a directory; "{stdlib}" is this Python's standard library), include, exclude and
                max_bytes (directories only)
    [params]    the workload's params; the older name [hyperparameters] still works (not both)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from gpuswarm.client.pack import Pack, PackError, pack_directory, pack_file
from gpuswarm.proto.models import ENTRYPOINT_PATTERN, JobSpec
from gpuswarm.proto.strict import OwnerModel, error_details
from gpuswarm.proto.workloads import WORKLOADS
from pydantic import Field, ValidationError, field_validator

_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
LOCAL_CHECK_TIMEOUT = 300.0  # importing torch and the owner's code can take a while on a cold disk
_PLACEHOLDER_SHA = "0" * 64
DATASET_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$"  # proto.models.DatasetRef.name
Globs = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=256)]


class JobFileError(ValueError):
    """A job file, flag or --param that does not make a valid job spec; the message says which key and why."""


class CodeSection(OwnerModel):
    """[code]: the owner's training code and the factory in it."""

    path: str
    entrypoint: str
    exclude: Globs = []

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, value: str) -> str:
        if not re.match(ENTRYPOINT_PATTERN, value):
            raise ValueError(f"must look like package.module:function, got {value!r}")
        return value


class DatasetSection(OwnerModel):
    """[dataset]: one file, or a directory packed with include/exclude globs up to max_bytes."""

    path: str
    include: Globs = []
    exclude: Globs = []
    max_bytes: Annotated[int, Field(ge=1)] | None = None


@dataclass(frozen=True)
class CodeSource:
    path: Path  # resolved: a directory or a .whl file
    entrypoint: str
    exclude: tuple[str, ...] = ()

    @property
    def format(self) -> str:
        return "tar" if self.path.is_dir() else "wheel"


@dataclass(frozen=True)
class DataSource:
    path: Path  # resolved: a file or a directory
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    max_bytes: int | None = None

    @property
    def format(self) -> str:
        return "tar" if self.path.is_dir() else "file"

    @property
    def name(self) -> str:
        """The dataset's name on the wire (its file or directory name), made to fit `DatasetRef.name`."""
        name = re.sub(r"[^A-Za-z0-9_.+-]", "_", self.path.name)[:128] or "dataset"
        return name if re.match(DATASET_NAME_PATTERN, name) else f"_{name[:127]}"


@dataclass(frozen=True)
class JobFile:
    """A job file read and checked, not packed yet: the spec's keys as a table, and the sources to pack."""

    file: Path | None
    table: dict[str, Any]  # the JobSpec's keys, without code and dataset
    code: CodeSource | None = None
    dataset: DataSource | None = None

    @property
    def where(self) -> str:
        return f" in {self.file}" if self.file is not None else ""


@dataclass(frozen=True)
class BuiltJob:
    """The wire spec and the packs whose bytes it refers to (None: the job has no such part)."""

    spec: JobSpec
    code: Pack | None = None
    dataset: Pack | None = None
    local_check: bool = False  # the params were checked against the code's own schema
    blobs: list[Pack] = field(default_factory=list)


OnPack = Callable[[str, Pack], None]  # called with "code" or "dataset" as each pack is made


def build_job(file: Path | None, overrides: dict[str, Any], params: list[str], *, local_check: bool = True,
              on_pack: OnPack | None = None, cache: Path | None = None,
              table: dict[str, Any] | None = None) -> BuiltJob:
    """The job of `file` (TOML; None: flags only) with `overrides` applied and `params` as its params, packed.

    `overrides` maps a key path ("budget", "stop.max_epochs") to a value; None values are flags not given and
    leave the file's value alone. `params` are "NAME=VALUE" strings from --param: each value is read as the type
    the built-in workload's schema gives NAME (so "64" is an int for an int parameter), else as JSON, else as text.
    `local_check`: check the params of the owner's code against its schema, in a child process, and post the
    params as it normalized them. `cache`: the pack cache (default `pack.cache_dir()`). `table`: the job's table
    when another file holds it (a sweep file's [job]); `file` is then that file, which relative paths start from."""
    job = read_job(file, overrides, params, table)
    code, dataset = pack_job(job, on_pack, cache)
    normalized = None
    if job.code is not None and local_check:
        normalized = check_params(job.code, job.table.get("hyperparameters", {}))
    spec = make_spec(job, code, dataset, normalized)
    return BuiltJob(spec, code, dataset, normalized is not None, [p for p in (code, dataset) if p is not None])


def build_spec(file: Path | None, overrides: dict[str, Any], params: list[str], **options: Any) -> JobSpec:
    """`build_job(...).spec`: for callers that only need the wire spec."""
    return build_job(file, overrides, params, **options).spec


# ---------------------------------------------------------------------------------------------------- reading


def read_job(file: Path | None, overrides: dict[str, Any], params: list[str],
             table: dict[str, Any] | None = None) -> JobFile:
    """The job file merged with the flags, every key checked (see `build_job`); nothing is packed yet."""
    table = dict(table) if table is not None else read_job_file(file) if file is not None else {}
    _rename_params(table, file)
    for key, value in overrides.items():
        if value is not None:
            _set(table, key, value)
    schema = WORKLOADS.get(table.get("workload")) if isinstance(table.get("workload"), str) else None
    for item in params:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise JobFileError(f"--param takes NAME=VALUE, got {item!r}")
        _set(table, f"hyperparameters.{name}", param_value(schema, name, raw))
    base = file.parent if file is not None else Path.cwd()
    problems: list[str] = []
    code_table, data_table = table.pop("code", None), table.pop("dataset", None)
    code = _code_source(code_table, base, problems)
    dataset = _data_source(data_table, base, problems)
    job = JobFile(file, table, code, dataset)
    # The rest is checked now, with stand-ins for the packs, so that a typo fails before a large dataset is packed
    # (and a [code] with a problem of its own still counts as code).
    problems += _spec_problems(_spec_table(job, _stand_in(code_table, "code"), _stand_in(data_table, "dataset")))
    if problems:
        raise JobFileError(f"invalid job spec{job.where}:\n" + "\n".join(f"  {p}" for p in problems))
    return job


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


def _rename_params(table: dict[str, Any], file: Path | None) -> None:
    """[params] is the JobSpec's `hyperparameters` (the older name, still read)."""
    if "params" not in table:
        return
    if "hyperparameters" in table:
        where = f" in {file}" if file is not None else ""
        raise JobFileError(f"invalid job spec{where}:\n  params: [params] and [hyperparameters] are the same "
                           f"table; use one (params)")
    table["hyperparameters"] = table.pop("params")


def _set(spec: dict[str, Any], path: str, value: Any) -> None:
    section, _, key = path.partition(".")
    if not key:
        spec[section] = value
        return
    table = spec.setdefault(section, {})
    if not isinstance(table, dict):
        raise JobFileError(f"{section}: must be a table to set {path}, got {type(table).__name__} {table!r}")
    table[key] = value


def _section(model: type[OwnerModel], name: str, value: Any, problems: list[str]) -> Any:
    """`value` (a [code] or [dataset] table) checked as `model`; None (and its problems noted) when it is not."""
    if not isinstance(value, dict):
        problems.append(f"{name}: must be a table ([{name}] with path = ...), got {type(value).__name__}")
        return None
    try:
        return model.model_validate(value)
    except ValidationError as e:
        problems.extend(f"{name}.{d['field']}" + f": {d['message']}" for d in error_details(e))
        return None


def expand_path(raw: str, base: Path) -> Path:
    """A path from the job file: "{stdlib}" is this Python's standard library, ~ is home, relative is to `base`."""
    expanded = raw.replace("{stdlib}", sysconfig.get_paths()["stdlib"])
    path = Path(expanded).expanduser()
    return (path if path.is_absolute() else base / path).resolve()


def _code_source(value: Any, base: Path, problems: list[str]) -> CodeSource | None:
    if value is None:
        return None
    section = _section(CodeSection, "code", value, problems)
    if section is None:
        return None
    path = expand_path(section.path, base)
    if not path.exists():
        problems.append(f"code.path: no such file or directory: {path}")
        return None
    if not (path.is_dir() or (path.is_file() and path.suffix == ".whl")):
        problems.append(f"code.path: {path} is neither a directory nor a .whl file")
        return None
    if path.is_file() and section.exclude:
        problems.append("code.exclude: only for a directory; a wheel is uploaded as it is")
    return CodeSource(path, section.entrypoint, tuple(section.exclude))


def _data_source(value: Any, base: Path, problems: list[str]) -> DataSource | None:
    if value is None:
        return None
    section = _section(DatasetSection, "dataset", value, problems)
    if section is None:
        return None
    path = expand_path(section.path, base)
    if not path.exists():
        problems.append(f"dataset.path: no such file or directory: {path}")
        return None
    if not (path.is_dir() or path.is_file()):
        problems.append(f"dataset.path: {path} is neither a file nor a directory")
        return None
    if path.is_file():
        problems.extend(f"dataset.{key}: only for a directory; a file is uploaded as it is"
                        for key in ("include", "exclude", "max_bytes") if getattr(section, key))
    return DataSource(path, tuple(section.include), tuple(section.exclude), section.max_bytes)


# ---------------------------------------------------------------------------------------------------- packing


def pack_job(job: JobFile, on_pack: OnPack | None = None, cache: Path | None = None) -> tuple[Pack | None,
                                                                                                Pack | None]:
    """The code and dataset packs of `job` (None where it has none); `on_pack(part, pack)` after each."""
    code = dataset = None
    try:
        if job.code is not None:
            code = pack_directory(job.code.path, exclude=job.code.exclude, cache=cache) \
                if job.code.format == "tar" else pack_file(job.code.path, "wheel", cache)
            if on_pack is not None:
                on_pack("code", code)
        if job.dataset is not None:
            d = job.dataset
            dataset = pack_directory(d.path, include=d.include, exclude=d.exclude, max_bytes=d.max_bytes,
                                     cache=cache) if d.format == "tar" else pack_file(d.path, "file", cache)
            if on_pack is not None:
                on_pack("dataset", dataset)
    except PackError as e:
        part = "dataset" if code is not None or job.code is None else "code"
        raise JobFileError(f"cannot pack the {part}{job.where}: {e}") from None
    return code, dataset


# ---------------------------------------------------------------------------------------------------- params check


def check_params(code: CodeSource, params: dict[str, Any], timeout: float = LOCAL_CHECK_TIMEOUT) -> dict[str, Any]:
    """The params as the code's own schema normalizes them, checked in a child process that imports the code (its
    source directory, or the wheel); a bad param, an import error or a check that cannot run is a JobFileError."""
    # -P: the child's working directory is not put on sys.path, so only `code` (and the installed packages) import.
    command = [sys.executable, "-P", "-m", "gpuswarm.sdk.loader", "--code", str(code.path),
               "--entrypoint", code.entrypoint, "--params", json.dumps(params)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise JobFileError(f"the local check of {code.entrypoint} took over {timeout:g}s; pass --no-local-check "
                           f"to skip it") from None
    answer = _loader_answer(proc.stdout)
    if answer is None:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise JobFileError(f"the local check of the params could not run ({last}); it needs the node's packages "
                           f"(pip install 'gpuswarm[node]'), or pass --no-local-check to skip it")
    if not answer.get("ok"):
        raise JobFileError(f"{code.entrypoint}: {answer.get('error')}")
    normalized = answer.get("params")
    if not isinstance(normalized, dict):
        raise JobFileError(f"the local check of {code.entrypoint} answered params that are not a table")
    return normalized


def _loader_answer(stdout: str) -> dict[str, Any] | None:
    """The loader's JSON line: the last line of its output that is a JSON object with "ok" (owners' code may print
    on import)."""
    for line in reversed(stdout.splitlines()):
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict) and "ok" in answer:
            return answer
    return None


# ---------------------------------------------------------------------------------------------------- the spec


def make_spec(job: JobFile, code: Pack | None, dataset: Pack | None,
              params: dict[str, Any] | None = None) -> JobSpec:
    """The wire spec of `job` with the packs' hashes (and `params`, the normalized params, when checked)."""
    code_ref = None if job.code is None or code is None else {
        "sha256": code.sha256, "size": code.size, "format": code.format, "entrypoint": job.code.entrypoint}
    data_ref = None if job.dataset is None or dataset is None else {
        "sha256": dataset.sha256, "size": dataset.size, "format": dataset.format, "name": job.dataset.name}
    table = _spec_table(job, code_ref, data_ref)
    if params is not None:
        table["hyperparameters"] = params
    try:
        return JobSpec.model_validate(table)
    except ValidationError as e:
        problems = "\n".join(f"  {d['field'] or 'job spec'}: {d['message']}" for d in error_details(e))
        raise JobFileError(f"invalid job spec{job.where}:\n{problems}") from None


def _spec_table(job: JobFile, code: dict | None, dataset: dict | None) -> dict[str, Any]:
    table = dict(job.table)
    if code is not None:
        table["code"] = code
    if dataset is not None:
        table["dataset"] = dataset
    return table


def _stand_in(section: Any, part: str) -> dict | None:
    """A valid reference in place of a pack not made yet, so that the rest of the spec can be checked."""
    if section is None:
        return None
    if part == "code":
        return {"sha256": _PLACEHOLDER_SHA, "size": 0, "format": "tar", "entrypoint": "stand.in:factory"}
    return {"sha256": _PLACEHOLDER_SHA, "size": 0, "format": "file", "name": "stand-in"}


def _spec_problems(table: dict[str, Any]) -> list[str]:
    try:
        JobSpec.model_validate(table)
    except ValidationError as e:
        return [f"{d['field'] or 'job spec'}: {d['message']}" for d in error_details(e)]
    return []


# ---------------------------------------------------------------------------------------------------- --param


def param_value(schema: Any, name: str, raw: str) -> Any:
    """A --param value as the type `schema` (a workload's hyper-parameter model, or None) declares for `name`.

    A value that does not read as that type is passed on as text, so the strict check names the parameter."""
    declared = schema.model_fields.get(name) if schema is not None else None
    kind = _scalar_type(declared.annotation) if declared is not None else None
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
