"""Workloads on the SDK, in-process and without hivemind: the built-in digits-mlp through the registry, and the two
examples (tinylm, byo) imported from their code directories the way the node imports a job owner's code."""

from __future__ import annotations

import collections
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gpuswarm.node.workloads import BUILTINS, resolve_builtin
from gpuswarm.node.workloads.digits import DigitsMLP, bundled_digits, stratified_split
from gpuswarm.proto.workloads import WORKLOADS
from gpuswarm.sdk import Context, Shard, Workload
from gpuswarm.sdk.loader import WorkloadError, import_entrypoint, params_dict, validate_params
from hypothesis import given
from hypothesis import strategies as st

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINYLM = ("tinylm.workload:TinyLM", EXAMPLES / "tinylm")
BYO = ("mymodel.workload:MyWorkload", EXAMPLES / "byo")
TINY_LM_PARAMS = {"context": 16, "d_model": 32, "n_layer": 1, "n_head": 2, "batch_size": 8, "chunk": 64,
                  "val_windows": 4, "learning_rate": 1e-2}


@pytest.fixture(autouse=True)
def restore_sys_path():
    """import_entrypoint puts code directories on sys.path; leave it as it was for other tests."""
    before = list(sys.path)
    yield
    sys.path[:] = before


def build(factory, params: dict, dataset: Path | None = None, tmp_path: Path = Path("."), seed: int = 0) -> Workload:
    """What the node does: validate params against the factory's schema, then call it with a Context."""
    return factory(Context(params=validate_params(factory, params), dataset=dataset, device=torch.device("cpu"),
                           workdir=tmp_path, seed=seed))


def train(workload: Workload, model: torch.nn.Module, shard: Shard, steps: int) -> None:
    optimizer = workload.optimizer().build(model.parameters())
    batches = workload.batches(shard)
    for _ in range(steps):
        workload.loss(model, next(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()


def measure(workload: Workload, model: torch.nn.Module) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        metrics = workload.evaluate(model)
    model.train()
    return metrics


# -- built-ins ---------------------------------------------------------------------------------------------------

def test_every_catalogued_workload_is_built_in_with_proto_schema():
    assert set(BUILTINS) == set(WORKLOADS)
    for name in BUILTINS:
        cls = resolve_builtin(name)
        assert issubclass(cls, Workload) and cls.Params is WORKLOADS[name]
    with pytest.raises(WorkloadError, match="no built-in workload 'nope'.*digits-mlp"):
        resolve_builtin("nope")


# A trainer's start for a job owner's code (tinylm), with the worker's import of the model file format, in a
# process of its own: the libraries that only a built-in needs stay unimported.
OWNER_CODE_START = """
import json, sys, types
from pathlib import Path
from gpuswarm.node.trainer import build_workload
from gpuswarm.node.workloads import saved
import torch
code, dataset, work, params = sys.argv[1:]
spec = types.SimpleNamespace(code=types.SimpleNamespace(entrypoint="tinylm.workload:TinyLM"), workload=None,
                             hyperparameters=json.loads(params), label="tinylm")
workload, _ = build_workload(spec, Path(code), Path(dataset), torch.device("cpu"), Path(work))
workload.build_model()
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"sklearn", "scipy"})))
"""


def builtin_libraries_imported(code: str, *args: str) -> list[str]:
    """Run `code` in a Python process of its own; the libraries of digits-mlp's data it printed as imported."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_trainer_for_owner_code_never_imports_what_only_a_builtin_needs(python_files, tmp_path):
    # scikit-learn with scipy (digits-mlp's data) was a third of every trainer's imports: 2 CPU-seconds.
    assert builtin_libraries_imported(OWNER_CODE_START, str(EXAMPLES / "tinylm"), str(python_files), str(tmp_path),
                                      json.dumps(TINY_LM_PARAMS)) == []


def test_digits_are_scikit_learns_and_the_split_is_fixed_and_stratified():
    from sklearn.datasets import load_digits

    x, y = bundled_digits()
    sk_x, sk_y = load_digits(return_X_y=True)
    assert np.array_equal(x, sk_x) and np.array_equal(y, sk_y)
    train, test = stratified_split(y, 0.2, seed=0)
    assert len(test) == 360 and len(train) == 1437
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(len(y)))  # disjoint, covering
    for label, count in zip(*np.unique(y, return_counts=True), strict=True):
        assert abs((y[test] == label).sum() - 0.2 * count) < 1  # each digit's share of the test split
    again = stratified_split(y, 0.2, seed=0)
    assert np.array_equal(train, again[0]) and np.array_equal(test, again[1])
    assert not np.array_equal(test, stratified_split(y, 0.2, seed=1)[1])


@given(labels=st.lists(st.integers(0, 5), min_size=1, max_size=300), fraction=st.floats(0.01, 0.99),
       seed=st.integers(0, 2**32 - 1))
def test_a_stratified_split_partitions_the_samples_in_proportion(labels, fraction, seed):
    y = np.array(labels)
    train, test = stratified_split(y, fraction, seed)
    assert len(test) == math.ceil(fraction * len(y))
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(len(y)))
    for label, count in zip(*np.unique(y, return_counts=True), strict=True):
        assert abs((y[test] == label).sum() - count * len(test) / len(y)) < 1


def test_a_digits_trainer_never_imports_scikit_learn():
    code = ("import json, sys; from gpuswarm.node.workloads import resolve_builtin; "
            "from gpuswarm.node.workloads.digits import digits_split; resolve_builtin('digits-mlp'); digits_split(); "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'sklearn', 'scipy'})))")
    assert builtin_libraries_imported(code) == []


def test_digits_shards_are_disjoint_and_cover_the_training_set(tmp_path):
    cls = resolve_builtin("digits-mlp")
    workload = build(cls, {"batch_size": 50}, tmp_path=tmp_path)
    assert workload.train_size == 1437 and workload.batch_size == 50
    seen = collections.Counter()
    for index in range(3):
        batches = workload.batches(Shard(index, 3, seed=11))
        rows = 0
        while rows < len(range(index, workload.train_size, 3)):  # one pass over the shard
            x, y = next(batches)
            assert x.shape[1] == 64 and y.dtype == torch.long
            seen.update((xi.numpy().tobytes(), int(yi)) for xi, yi in zip(x, y, strict=True))
            rows += len(y)
    x_train, y_train = workload._x_train, workload._y_train
    assert seen == collections.Counter((xi.numpy().tobytes(), int(yi)) for xi, yi in zip(x_train, y_train,
                                                                                        strict=True))


def test_digits_stream_is_deterministic_per_shard_and_model_init_per_seed(tmp_path):
    workload = build(DigitsMLP, {}, tmp_path=tmp_path)
    first = next(workload.batches(Shard(1, 2, seed=5)))[1]
    assert torch.equal(first, next(workload.batches(Shard(1, 2, seed=5)))[1])
    assert not torch.equal(first, next(workload.batches(Shard(1, 2, seed=6)))[1])
    a, b = workload.build_model(), workload.build_model()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_digits_trains_and_evaluates_named_metrics(tmp_path):
    workload = build(DigitsMLP, {"learning_rate": 0.02}, tmp_path=tmp_path)
    model = workload.build_model()
    before = measure(workload, model)
    train(workload, model, Shard(0, 1, seed=0), steps=120)
    after = measure(workload, model)
    assert set(after) == {"loss", "accuracy"}
    assert after["loss"] < before["loss"] and after["accuracy"] > 0.85


# -- tinylm ------------------------------------------------------------------------------------------------------

@pytest.fixture
def python_files(tmp_path) -> Path:
    root = tmp_path / "src"
    for i in range(12):
        pkg = root / f"pkg{i % 3}"
        pkg.mkdir(parents=True, exist_ok=True)
        body = "".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(15))
        (pkg / f"mod{i}.py").write_text(f'"""Module {i}."""\n\nimport os\n\n' + body)
    return root


def test_tinylm_learns_and_reports_bits_per_byte(python_files, tmp_path):
    factory = import_entrypoint(*TINYLM)
    workload = build(factory, TINY_LM_PARAMS, dataset=python_files, tmp_path=tmp_path)
    model = workload.build_model()
    assert workload.train_size > 0
    probe = next(workload.batches(Shard(0, 1, seed=99)))
    assert probe.shape == (8, 17) and probe.dtype == torch.uint8
    with torch.no_grad():
        loss_before = workload.loss(model, probe).item()
    train(workload, model, Shard(0, 1, seed=0), steps=30)
    with torch.no_grad():
        assert workload.loss(model, probe).item() < loss_before - 0.5
    metrics = measure(workload, model)
    assert set(metrics) == {"val_loss", "val_bpb"}
    assert math.isfinite(metrics["val_bpb"]) and metrics["val_bpb"] == pytest.approx(metrics["val_loss"] / math.log(2))
    assert metrics["val_bpb"] < 8.0  # better than uniform over 256 bytes


def test_tinylm_shards_differ_and_replay(python_files, tmp_path):
    factory = import_entrypoint(*TINYLM)
    workload = build(factory, TINY_LM_PARAMS, dataset=python_files, tmp_path=tmp_path)
    zero = next(workload.batches(Shard(0, 2, seed=3)))
    assert torch.equal(zero, next(workload.batches(Shard(0, 2, seed=3))))
    assert not torch.equal(zero, next(workload.batches(Shard(1, 2, seed=3))))
    # Every member builds the same initial weights from the job's seed.
    a, b = workload.build_model(), workload.build_model()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_tinylm_needs_a_dataset(tmp_path):
    factory = import_entrypoint(*TINYLM)
    with pytest.raises(ValueError, match="needs a dataset"):
        build(factory, TINY_LM_PARAMS, dataset=None, tmp_path=tmp_path)


# -- byo ---------------------------------------------------------------------------------------------------------

def test_byo_make_data_then_train(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(EXAMPLES / "byo" / "make_data.py"), "--out", str(data), "--train", "600",
                    "--val", "200"], check=True, capture_output=True)
    assert sorted(p.name for p in data.iterdir()) == ["train_x.npy", "train_y.npy", "val_x.npy", "val_y.npy"]
    factory = import_entrypoint(*BYO)
    workload = build(factory, {"batch_size": 32}, dataset=data, tmp_path=tmp_path)
    assert workload.train_size == 600
    model = workload.build_model()
    before = measure(workload, model)
    train(workload, model, Shard(0, 2, seed=1), steps=40)
    after = measure(workload, model)
    assert set(after) == {"loss", "accuracy"} and after["loss"] < before["loss"]
    x, y = next(workload.batches(Shard(1, 2, seed=1)))
    assert x.shape == (32, 8) and workload.batch_samples((x, y)) == 32


# -- loading owners' code ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("entrypoint", "code"), [TINYLM, BYO])
def test_loader_imports_example_entrypoints_and_fills_defaults(entrypoint, code):
    factory = import_entrypoint(entrypoint, code)
    params = validate_params(factory, {"batch_size": 8})
    assert issubclass(factory, Workload) and params.batch_size == 8
    assert params_dict(params)["learning_rate"] == factory.Params().learning_rate


@pytest.mark.parametrize(("entrypoint", "code", "params", "message"), [
    (*TINYLM, {"d_model": 100, "n_head": 6}, r"d_model \(100\) must be a multiple of n_head \(6\)"),
    (*TINYLM, {"lerning_rate": 0.1}, r"lerning_rate: "),
    (*BYO, {"hidden": "wide"}, r"hidden: Input should be a valid integer"),
    (*BYO, {"batch_size": 0}, r"batch_size: Input should be greater than or equal to 1"),
])
def test_loader_rejects_bad_params_readably(entrypoint, code, params, message):
    factory = import_entrypoint(entrypoint, code)
    with pytest.raises(WorkloadError, match=r"^invalid params: .*" + message):
        validate_params(factory, params)


def test_loader_names_a_missing_entrypoint():
    with pytest.raises(WorkloadError, match="has no callable 'Nope'"):
        import_entrypoint("tinylm.workload:Nope", EXAMPLES / "tinylm")
