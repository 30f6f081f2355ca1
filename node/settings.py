"""The node daemon's settings: one model (`NodeSettings`, pydantic-settings) read from a TOML file, then
environment variables (`GPUSWARM_NODE_<FIELD>`), then `gpuswarm node start` flags, each overriding the one before.

Owns the fields, their defaults and their documentation (one `description` each, which the flags' help and the
file `render_toml` writes both use), where the file is looked for (`--config`, else `GPUSWARM_NODE_CONFIG`, else
`DEFAULT_CONFIG` when it exists), and `render_toml`: the commented file `gpuswarm node init` writes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from gpuswarm.proto.models import DatasetName
from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_CONFIG = Path("/etc/gpuswarm/node.toml")
DATASET_NAME = DatasetName.__metadata__[0]  # proto's constraint on a dataset's name
MAX_DATASETS = 64  # as many as a node's advert (proto.models.Resources.datasets) holds
CONFIG_ENV = "GPUSWARM_NODE_CONFIG"


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUSWARM_NODE_", extra="forbid", validate_default=True)

    coordinator: str = Field("http://127.0.0.1:8470", description=(
        "Coordinator base URL; several, comma-separated, to fail over between the coordinators of one database."))
    state_dir: Path = Field(Path("var/node"), description="Identity key, outbox, job files and the artifact cache.")
    host: str = Field("127.0.0.1", description=(
        "Address hivemind binds and announces (loopback or LAN; the mesh address once the WireGuard mesh exists)."))
    price: float = Field(0.0, ge=0, description="Ask price per GPU-hour, in credits.")
    cpu: bool = Field(False, description="Offer CPU only, even if GPUs are present.")
    mesh: bool = Field(True, description=(
        "Join the WireGuard mesh (needs root, or CAP_NET_ADMIN, and wireguard-go or the kernel module). false: "
        "loopback or LAN, UNENCRYPTED, for development."))
    listen_port: int = Field(51820, ge=1, le=65535, description="WireGuard UDP port.")
    endpoints: Annotated[list[str], NoDecode] = Field(default_factory=list, description=(
        "HOST:PORT where peers can reach this node's WireGuard (default: the local addresses); in the "
        "environment, comma-separated."))
    metrics_port: int = Field(0, ge=0, le=65535, description=(
        "Serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (9465 is customary); 0: off."))
    metrics_host: str = Field("127.0.0.1", description=(
        "Address the metrics endpoint binds (unauthenticated: keep it on loopback or a private network)."))
    allow_custom_code: bool = Field(False, description=(
        "Run job owners' own training code, sandboxed (advertised: the matcher sends such jobs only to nodes "
        "that opted in). Built-in workloads run either way."))
    datasets: dict[str, Path] = Field(default_factory=dict, description=(
        "Datasets kept on this node for federated jobs: a table of name to path (a file or a directory). A job "
        "names one (local_dataset); only nodes holding it take the job, and its data never leave the node. In the "
        "environment, JSON."))
    cache_gb: float = Field(20.0, gt=0, description="Bound of the artifact cache under state_dir/cache, in GiB.")
    sandbox_memory_gb: float = Field(8.0, ge=0.1, description=(
        "Memory one job's code may use (cgroup memory.max, else RLIMIT_DATA), in GiB."))
    sandbox_processes: int = Field(256, ge=16, description=(
        "Processes and threads one job's code may run (cgroup pids.max, else RLIMIT_NPROC)."))
    step_timeout: float = Field(600.0, ge=1, description=(
        "Seconds a job's code may take for one step, evaluation or save before it is stopped as hung."))
    max_job_hours: float | None = Field(None, gt=0, description=(
        "Wall-time limit of one job on this node, in hours (unset: none)."))
    warm_worker: bool = Field(True, description=(
        "Keep a warmed-up training process while idle (torch and hivemind loaded), so that the next job starts "
        "seconds sooner; it costs about 480 MB of memory."))
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Least severe level logged.")
    log_format: Literal["text", "json"] = Field("text", description=(
        "text: for people; json: one object per line (ts, level, logger, msg, pid, process, exc)."))

    @field_validator("datasets")
    @classmethod
    def _dataset_names(cls, value: dict[str, Path]) -> dict[str, Path]:
        if len(value) > MAX_DATASETS:
            raise ValueError(f"at most {MAX_DATASETS} datasets")
        for name in value:
            if not re.fullmatch(DATASET_NAME.pattern, name):
                raise ValueError(f"dataset name {name!r}: letters, digits and _.+- only, at most 128")
        return value

    @field_validator("endpoints", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)  # model_config["toml_file"]


def config_file(explicit: Path | None) -> Path | None:
    """The file to read: `--config`, else $GPUSWARM_NODE_CONFIG, else DEFAULT_CONFIG if it exists. A file named
    explicitly must exist."""
    named = explicit or (Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None)
    if named is not None:
        if not named.is_file():
            raise FileNotFoundError(f"no node config at {named}")
        return named
    return DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None


def load(path: Path | None, **flags: Any) -> NodeSettings:
    """The settings from `path` (TOML), the environment, then `flags` (only those given on the command line)."""
    class FromFile(NodeSettings):
        model_config = SettingsConfigDict(toml_file=path)

    return FromFile(**{k: v for k, v in flags.items() if v is not None})


def render_toml(values: dict[str, Any] | None = None) -> str:
    """The commented config `gpuswarm node init` writes: every field with its description; those in `values`
    set, the rest commented out at their defaults."""
    values = values or {}
    lines = ["# gpuswarm node configuration (gpuswarm node start --config FILE).",
             "# Read first; then GPUSWARM_NODE_<SETTING> environment variables; then `gpuswarm node start` flags.",
             ""]
    for name, field in NodeSettings.model_fields.items():
        lines.append(f"# {field.description}")
        if name in values:
            lines.append(f"{name} = {_toml(values[name])}")
        else:
            default = field.get_default(call_default_factory=True)
            lines.append(f"# {name} = {_toml(default)}" if default is not None else f"# {name} =")
        lines.append("")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    import json

    if isinstance(value, dict):  # an inline table; quoted keys take any name
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))  # a TOML basic string is a JSON string
