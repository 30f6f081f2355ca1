"""Job files that bring their own code and data (client/jobfile.py): [code], [dataset] and [params] read, checked
and packed into a JobSpec by hashes; the owner's params checked by the real `python -m gpuswarm.sdk.loader` in a
child process. Real files on disk, no coordinator."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest
from gpuswarm.client.jobfile import JobFileError, build_job, build_spec, check_params, read_job
from gpuswarm.client.pack import pack_directory

WORKLOAD = '''
from pydantic import BaseModel, ConfigDict


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hidden: int = 8
    lr: float = 0.1


def TinyLM(ctx):
    raise RuntimeError("not built in these tests")


TinyLM.Params = Params
'''

JOB = '''
name = "tinylm"
min_nodes = 2
max_nodes = 3
budget = 5.0

[code]
path = "."
entrypoint = "tinylm.workload:TinyLM"
exclude = ["data/*", "job.toml"]

[dataset]
path = "data/train.npy"

[params]
hidden = 16

[stop]
target = "val_bpb <= 2.2"
max_steps = 2000

[training]
precision = "bf16"
checkpoint_every_steps = 50
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A job owner's project: a package, a dataset file and the job file, as the brief's example."""
    root = tmp_path / "project"
    (root / "tinylm").mkdir(parents=True)
    (root / "tinylm/__init__.py").write_text("")
    (root / "tinylm/workload.py").write_text(WORKLOAD)
    (root / "data").mkdir()
    (root / "data/train.npy").write_bytes(bytes(range(256)) * 40)
    (root / "job.toml").write_text(JOB)
    return root


def build(root: Path, text: str | None = None, params: list[str] | None = None, **options):
    if text is not None:
        (root / "job.toml").write_text(text)
    return build_job(root / "job.toml", {}, params or [], cache=root.parent / "cache", **options)


def refusal(root: Path, text: str, **options) -> str:
    with pytest.raises(JobFileError) as caught:
        build(root, text, **options)
    return str(caught.value)


def test_a_code_job_is_packed_checked_and_referred_to_by_hashes(project):
    built = build(project)
    spec = built.spec
    assert spec.workload is None and spec.label == "tinylm.workload:TinyLM"
    assert (spec.code.format, spec.code.entrypoint) == ("tar", "tinylm.workload:TinyLM")
    assert spec.code.sha256 == built.code.sha256 == hashlib.sha256(built.code.path.read_bytes()).hexdigest()
    with tarfile.open(built.code.path) as tar:  # data/* and the job file are left out
        assert tar.getnames() == ["tinylm", "tinylm/__init__.py", "tinylm/workload.py"]
    data = (project / "data/train.npy").read_bytes()
    assert (spec.dataset.format, spec.dataset.name, spec.dataset.size) == ("file", "train.npy", len(data))
    assert spec.dataset.sha256 == hashlib.sha256(data).hexdigest() and built.dataset.path == project / "data/train.npy"
    assert spec.hyperparameters == {"hidden": 16, "lr": 0.1}  # normalized by the code's own schema
    assert built.local_check and spec.stop.target == "val_bpb <= 2.2" and spec.stop.max_steps == 2000
    assert (spec.training.precision, spec.training.checkpoint_every_steps) == ("bf16", 50)
    assert build_spec(project / "job.toml", {}, [], cache=project.parent / "cache", local_check=False) \
        == spec.model_copy(update={"hyperparameters": {"hidden": 16}})


def test_the_local_check_reports_a_bad_param(project):
    message = refusal(project, JOB.replace("hidden = 16", 'hidden = "big"'))
    assert message.startswith("tinylm.workload:TinyLM: invalid params: hidden: Input should be a valid integer")
    message = refusal(project, JOB.replace("hidden = 16", "hiden = 16"))
    assert "hiden: unknown param; did you mean 'hidden'?" in message
    built = build(project, JOB, params=["hidden=big"], local_check=False)  # posted as it is, checked on the node
    assert built.spec.hyperparameters == {"hidden": "big"} and not built.local_check


def test_params_from_the_command_line_are_json_then_normalized(project):
    assert build(project, params=["lr=0.5", "hidden=32"]).spec.hyperparameters == {"hidden": 32, "lr": 0.5}


def test_the_local_check_reports_an_import_error(project):
    (project / "tinylm/workload.py").write_text("import not_installed_anywhere\n")
    message = refusal(project, JOB)
    assert "cannot import 'tinylm.workload'" in message and "not_installed_anywhere" in message


def test_the_local_check_does_not_see_the_working_directory(project, monkeypatch):
    """-P: only the code path is importable, not whatever sits where the owner runs the command."""
    monkeypatch.chdir(project)
    source = read_job(project / "job.toml", {}, []).code
    assert check_params(source, {"hidden": 2}) == {"hidden": 2, "lr": 0.1}
    elsewhere = project.parent / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(JobFileError, match="cannot import 'tinylm"):
        check_params(type(source)(elsewhere, source.entrypoint), {})


def test_the_old_hyperparameters_name_still_works_but_not_both(project):
    renamed = build(project, JOB.replace("[params]", "[hyperparameters]"), local_check=False)
    assert renamed.spec.hyperparameters == {"hidden": 16}
    both = JOB + "\n[hyperparameters]\nlr = 0.2\n"
    assert "params: [params] and [hyperparameters] are the same table" in refusal(project, both)


def test_unknown_keys_in_code_and_dataset_are_named_with_the_rest(project):
    text = JOB.replace('exclude = ["data/*"', 'exclud = ["data/*"').replace('path = "data/train.npy"',
                                                                            'path = "data/train.npy"\nmax_byte = 3')
    message = refusal(project, text.replace("budget = 5.0", "budgett = 5.0"))
    assert message.startswith(f"invalid job spec in {project / 'job.toml'}:\n")
    assert set(message.splitlines()[1:]) == {"  code.exclud: unknown key; did you mean 'exclude'?",
                                             "  dataset.max_byte: unknown key; did you mean 'max_bytes'?",
                                             "  budgett: unknown key; did you mean 'budget'?"}


@pytest.mark.parametrize(("before", "after", "line"), [
    ('entrypoint = "tinylm.workload:TinyLM"', 'entrypoint = "tinylm.workload"',
     "code.entrypoint: must look like package.module:function, got 'tinylm.workload'"),
    ('path = "."', 'path = "nowhere"', "code.path: no such file or directory: {root}/nowhere"),
    ('path = "."', 'path = "data/train.npy"', "code.path: {root}/data/train.npy is neither a directory nor a .whl "
                                             "file"),
    ('path = "data/train.npy"', 'path = "data/missing.npy"',
     "dataset.path: no such file or directory: {root}/data/missing.npy"),
    ('path = "data/train.npy"', 'path = "data/train.npy"\ninclude = ["*.py"]',
     "dataset.include: only for a directory; a file is uploaded as it is"),
    ('path = "data/train.npy"', 'path = "data"\nmax_bytes = 0',
     "dataset.max_bytes: Input should be greater than or equal to 1"),
    ('path = "."', "path = 5", "code.path: Input should be a valid string, got the number 5"),
    ('exclude = ["data/*", "job.toml"]', 'exclude = "data/*"',
     "code.exclude: Input should be a valid list, got the string 'data/*'"),
])
def test_bad_code_and_dataset_sections_say_what_is_wrong(project, before, after, line):
    assert before in JOB
    message = refusal(project, JOB.replace(before, after, 1))
    assert f"  {line.format(root=project)}" in message.splitlines(), message


def test_code_and_a_workload_are_refused_together(project):
    message = refusal(project, 'workload = "digits-mlp"\n' + JOB)
    assert "a job names either a built-in workload or its own code" in message


def test_problems_are_found_before_anything_is_packed(project):
    refusal(project, JOB.replace("max_nodes = 3", "max_nodes = 1"))
    assert not (project.parent / "cache").exists()


def test_a_dataset_directory_is_packed_with_its_globs(project):
    (project / "data/more").mkdir()
    (project / "data/more/b.txt").write_text("b" * 10)
    (project / "data/a.txt").write_text("a" * 10)
    (project / "data/test").mkdir()
    (project / "data/test/c.txt").write_text("c")
    text = JOB.replace('path = "data/train.npy"', 'path = "data"\ninclude = ["*.txt"]\nexclude = ["test/*"]\n'
                                                  'max_bytes = 15')
    built = build(project, text, local_check=False)
    assert (built.spec.dataset.format, built.spec.dataset.name) == ("tar", "data")
    with tarfile.open(built.dataset.path) as tar:
        assert tar.getnames() == ["a.txt"]  # then more/b.txt would pass 15 bytes
    assert built.dataset.left_out == 1


def test_stdlib_expands_to_this_pythons_standard_library(project):
    text = JOB.replace('path = "data/train.npy"', 'path = "{stdlib}"\ninclude = ["json/*.py"]\n'
                                                  'exclude = ["test/*", "idlelib/*"]\nmax_bytes = 8000000')
    built = build(project, text, local_check=False)
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert built.dataset.source == stdlib and built.spec.dataset.name == stdlib.name
    assert built.dataset.files == len(list((stdlib / "json").glob("*.py")))
    again = pack_directory(stdlib, include=["json/*.py"], exclude=["test/*", "idlelib/*"], max_bytes=8000000,
                           cache=project.parent / "other-cache")
    assert again.sha256 == built.spec.dataset.sha256


def test_a_wheel_is_uploaded_as_it_is(project):
    import zipfile

    wheel = project / "tinylm-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(project / "tinylm/__init__.py", "tinylm/__init__.py")
        z.write(project / "tinylm/workload.py", "tinylm/workload.py")
    built = build(project, JOB.replace('path = "."', f'path = "{wheel.name}"').replace(
        'exclude = ["data/*", "job.toml"]', ""))
    assert built.spec.code.format == "wheel" and built.code.path == wheel
    assert built.spec.code.sha256 == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert built.spec.hyperparameters == {"hidden": 16, "lr": 0.1}  # checked from inside the wheel


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_byo_example_job_file_is_valid_after_its_data_script(tmp_path):
    project = tmp_path / "byo"
    shutil.copytree(EXAMPLES / "byo", project, ignore=shutil.ignore_patterns("data", "__pycache__", "*.pt"))
    subprocess.run([sys.executable, "make_data.py"], cwd=project, check=True, capture_output=True, timeout=120)
    job = build_job(project / "job.toml", {}, [], cache=tmp_path / "packs")
    spec = job.spec
    assert spec.code.entrypoint == "mymodel.workload:MyWorkload" and spec.code.format == "tar"
    assert spec.dataset.format == "tar" and spec.stop.target == "accuracy >= 0.9" and job.local_check
    with tarfile.open(job.code.path) as tar:
        names = tar.getnames()
    assert "mymodel/workload.py" in names and not any(n.startswith("data") for n in names)  # data travel apart


def test_the_tinylm_example_job_file_is_valid_and_packs_the_standard_library(tmp_path):
    job = build_job(EXAMPLES / "tinylm" / "job.toml", {}, [], cache=tmp_path / "packs")
    spec = job.spec
    assert spec.code.entrypoint == "tinylm.workload:TinyLM" and spec.stop.target == "val_bpb <= 4.4"
    assert spec.dataset.format == "tar" and 1_000_000 < spec.dataset.size <= 16_000_000 + 10_000_000
