"""The job file (client/jobfile.py): TOML, flag overrides and --param pairs become one strictly checked JobSpec.

Real files on disk; the last test runs the real `gpuswarm job validate` command in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpuswarm.client.jobfile import JobFileError, build_spec, param_value
from gpuswarm.proto.models import JobSpec
from gpuswarm.proto.strict import OwnerModel
from gpuswarm.proto.workloads import DigitsMLPParams

ROOT = Path(__file__).resolve().parents[2]

GOOD = """\
name = "digits"
workload = "digits-mlp"
min_nodes = 1
max_nodes = 2
budget = 5            # a whole number is a fine float
max_price_per_gpu_hour = 1.5

[stop]
max_epochs = 3

[requirements]
verified_only = true

[hyperparameters]
hidden = 64
"""

NO_FLAGS: dict = {}


def job_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def refusal(tmp_path: Path, text: str, overrides: dict | None = None, params: list[str] | None = None) -> str:
    file = job_file(tmp_path, text)
    with pytest.raises(JobFileError) as caught:
        build_spec(file, overrides or {}, params or [])
    return str(caught.value)


def test_a_good_file_makes_its_spec(tmp_path):
    spec = build_spec(job_file(tmp_path, GOOD), NO_FLAGS, [])
    assert isinstance(spec, JobSpec)
    assert spec.name == "digits" and spec.max_nodes == 2 and spec.budget == 5.0
    assert spec.stop.max_epochs == 3 and spec.requirements.verified_only is True
    assert spec.hyperparameters == DigitsMLPParams(hidden=64).model_dump()


def test_flags_override_the_file_and_none_leaves_it_alone(tmp_path):
    spec = build_spec(job_file(tmp_path, GOOD), {"name": None, "budget": 7.5, "stop.max_epochs": 9,
                                                 "stop.target_accuracy": 0.9, "requirements.verified_only": False},
                      [])
    assert spec.name == "digits" and spec.budget == 7.5
    assert spec.stop.max_epochs == 9 and spec.stop.target_accuracy == 0.9
    assert spec.requirements.verified_only is False


def test_flags_alone_make_a_spec():
    spec = build_spec(None, {"workload": "digits-mlp", "max_nodes": 3, "budget": None}, ["hidden=32"])
    assert spec.workload == "digits-mlp" and spec.max_nodes == 3 and spec.hyperparameters["hidden"] == 32


def test_params_are_read_as_the_schemas_types(tmp_path):
    spec = build_spec(job_file(tmp_path, GOOD), NO_FLAGS,
                      ["hidden=128", "learning_rate=0.05", "matchmaking_time=2", " seed = 7"])
    params = spec.hyperparameters
    assert params["hidden"] == 128 and params["learning_rate"] == 0.05 and params["seed"] == 7
    assert params["matchmaking_time"] == 2.0 and isinstance(params["matchmaking_time"], float)


class Knobs(OwnerModel):
    flag: bool = False
    label: str = ""
    ratio: float | None = None
    sizes: list[int] = []


@pytest.mark.parametrize(("name", "raw", "value"), [
    ("flag", "true", True), ("flag", "No", False), ("flag", "1", True), ("flag", "maybe", "maybe"),
    ("label", "42", "42"), ("ratio", "0.5", 0.5), ("ratio", "x", "x"), ("sizes", "[1, 2]", [1, 2]),
    ("unknown", "3", 3), ("unknown", "three", "three"),
])
def test_param_value(name, raw, value):
    assert param_value(Knobs, name, raw) == value


def test_param_value_without_a_schema_reads_json_else_text():
    assert param_value(None, "x", "5") == 5 and param_value(None, "x", "abc") == "abc"


def test_a_param_that_is_not_its_type_is_named(tmp_path):
    message = refusal(tmp_path, GOOD, params=["hidden=big"])
    assert "hyperparameters.hidden: Input should be a valid integer, got the string 'big'" in message


def test_a_param_without_a_value_is_refused(tmp_path):
    assert "--param takes NAME=VALUE, got 'hidden'" in refusal(tmp_path, GOOD, params=["hidden"])
    assert "--param takes NAME=VALUE" in refusal(tmp_path, GOOD, params=["=3"])


def test_unknown_keys_are_named_with_the_key_meant(tmp_path):
    text = GOOD.replace("budget = 5", "budgett = 5").replace("max_nodes = 2", "max_node = 2")
    text = text.replace("max_epochs = 3", "max_epoch = 3").replace("hidden = 64", "hiden = 64")
    message = refusal(tmp_path, text)
    assert message.startswith(f"invalid job spec in {tmp_path / 'job.toml'}:")
    lines = set(message.splitlines()[1:])
    assert lines == {"  budgett: unknown key; did you mean 'budget'?",
                     "  max_node: unknown key; did you mean 'max_nodes'?",
                     "  stop.max_epoch: unknown key; did you mean 'max_epochs'?",
                     "  hyperparameters.hiden: unknown key; did you mean 'hidden'?"}


@pytest.mark.parametrize(("before", "after", "line"), [
    ("max_nodes = 2", 'max_nodes = "2"', "max_nodes: Input should be a valid integer, got the string '2'"),
    ("min_nodes = 1", "min_nodes = true", "min_nodes: Input should be a valid integer, got the boolean true"),
    ("max_nodes = 2", "max_nodes = 2.0", "max_nodes: Input should be a valid integer, got the number 2.0"),
    ("verified_only = true", 'verified_only = "yes"',
     "requirements.verified_only: Input should be a valid boolean, got the string 'yes'"),
    ("budget = 5 ", 'budget = "5" ', "budget: Input should be a valid number, got the string '5'"),
])
def test_wrong_types_are_named(tmp_path, before, after, line):
    assert before in GOOD
    assert f"  {line}" in refusal(tmp_path, GOOD.replace(before, after)).splitlines()


def test_a_toml_syntax_error_names_the_line(tmp_path):
    message = refusal(tmp_path, GOOD.replace("max_nodes = 2", "max_nodes = "))
    assert message.startswith(f"job file {tmp_path / 'job.toml'} is not valid TOML: ")
    assert re.search(r"\bline 4\b", message), message


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(JobFileError, match="cannot read job file .*missing.toml"):
        build_spec(tmp_path / "missing.toml", NO_FLAGS, [])


def test_a_flag_into_a_key_that_is_not_a_table_is_refused(tmp_path):
    message = refusal(tmp_path, GOOD.replace("[stop]\nmax_epochs = 3\n", "").replace("name =", "stop = 5\nname ="),
                      overrides={"stop.max_epochs": 4})
    assert message.startswith("stop: must be a table")


def test_job_file_error_is_a_value_error():
    assert issubclass(JobFileError, ValueError)


def test_the_readme_job_file_is_valid(tmp_path):
    readme = (ROOT / "README.md").read_text()
    # The built-in job files (the owner-code example names paths of examples/byo: tests/client/test_jobfile_code.py)
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", readme, re.S) if re.search(r"^workload\s*=", b, re.M)]
    assert blocks, "the README has no job file example"
    for block in blocks:
        assert isinstance(build_spec(job_file(tmp_path, block), NO_FLAGS, []), JobSpec)


def test_job_validate_prints_the_same_message(tmp_path):
    """The real `gpuswarm job validate`, offline: exit 1 and the same words as build_spec and the API."""
    script = Path(sys.executable).with_name("gpuswarm")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gpuswarm.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")} | {"COLUMNS": "200"}
    file = job_file(tmp_path, GOOD.replace("budget = 5", "budgett = 5"))
    bad = subprocess.run([*command, "job", "validate", str(file)], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert bad.returncode == 1 and bad.stdout == ""
    assert "budgett: unknown key; did you mean 'budget'?" in bad.stderr
    file = job_file(tmp_path, GOOD)
    good = subprocess.run([*command, "job", "validate", str(file)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["budget"] == 5.0
