"""The model file a job leaves, read back: `gpuswarm.node.workloads.saved` and `gpuswarm node evaluate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gpuswarm.node.cli import node_app
from gpuswarm.node.workloads.digits import DigitsMLP
from gpuswarm.node.workloads.saved import (
    MODEL_FORMAT,
    evaluate_builtin,
    flat_optimizer_state,
    read_model_file,
    save_model_file,
)
from gpuswarm.sdk import Context, Shard
from gpuswarm.sdk.loader import WorkloadError, validate_params
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def trained_digits(tmp_path_factory):
    """A digits-mlp workload and its model after a short training run."""
    params = validate_params(DigitsMLP, {"hidden": 32})
    workload = DigitsMLP(Context(params=params, dataset=None, device=torch.device("cpu"),
                                 workdir=tmp_path_factory.mktemp("work")))
    model = workload.build_model()
    optimizer = workload.optimizer().build(model.parameters())
    batches = workload.batches(Shard(0, 1, seed=0))
    for _ in range(100):
        workload.loss(model, next(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        metrics = workload.evaluate(model)
    return workload, model, metrics


def save(path: Path, trained, **overrides) -> Path:
    workload, model, metrics = trained
    fields = {"workload": "digits-mlp", "entrypoint": None, "params": workload.params, "model": model,
              "metrics": metrics, "metadata": {"job_id": "j-0123456789ab", "global_step": 12, "epoch": 2.5}}
    save_model_file(path, **(fields | overrides))
    return path


def test_saved_file_is_plain_torch_and_reads_back(tmp_path, trained_digits):
    path = save(tmp_path / "model.pt", trained_digits)
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert raw["format"] == MODEL_FORMAT and raw["params"]["hidden"] == 32
    saved = read_model_file(path)
    assert saved.workload == "digits-mlp" and saved.metadata["global_step"] == 12
    assert evaluate_builtin(saved) == pytest.approx(trained_digits[2])


def test_evaluate_command_measures_a_builtin_again(tmp_path, trained_digits):
    path = save(tmp_path / "model.pt", trained_digits)
    result = CliRunner().invoke(node_app, ["evaluate", str(path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["workload"] == "digits-mlp" and out["accuracy"] > 0.85
    assert out["accuracy"] == pytest.approx(out["reported_accuracy"])
    text = CliRunner().invoke(node_app, ["evaluate", str(path)])
    assert text.exit_code == 0 and "digits-mlp accuracy" in text.output and "(reported " in text.output


def test_evaluate_command_reads_the_format_before_the_sdk(tmp_path, trained_digits):
    workload, model, metrics = trained_digits
    path = tmp_path / "old.pt"
    torch.save({"workload": "digits-mlp", "hyperparameters": workload.params.model_dump(),
                "state_dict": model.state_dict(), "metadata": {"accuracy": metrics["accuracy"]}}, path)
    out = json.loads(CliRunner().invoke(node_app, ["evaluate", str(path), "--json"]).output)
    assert out["accuracy"] == pytest.approx(metrics["accuracy"]) == pytest.approx(out["reported_accuracy"])


def test_a_custom_code_model_needs_its_owners_code(tmp_path, trained_digits):
    path = save(tmp_path / "custom.pt", trained_digits, workload=None, entrypoint="mymodel.workload:MyWorkload")
    with pytest.raises(WorkloadError, match="needs that code"):
        evaluate_builtin(read_model_file(path))
    result = CliRunner().invoke(node_app, ["evaluate", str(path)])
    assert result.exit_code == 2
    assert "mymodel.workload:MyWorkload" in result.output and "needs that code" in result.output
    assert "metrics saved with it: accuracy" in result.output


@pytest.mark.parametrize("content", [b"not a torch file", None])
def test_evaluate_command_refuses_what_is_not_a_model_file(tmp_path, content):
    path = tmp_path / "bad.pt"
    if content is None:
        torch.save({"weights": torch.zeros(2)}, path)
    else:
        path.write_bytes(content)
    result = CliRunner().invoke(node_app, ["evaluate", str(path)])
    assert result.exit_code == 1 and "not a gpuswarm model file" in result.output


def test_evaluate_command_names_an_unknown_builtin(tmp_path, trained_digits):
    path = save(tmp_path / "model.pt", trained_digits, workload="cifar-resnet")
    result = CliRunner().invoke(node_app, ["evaluate", str(path)])
    assert result.exit_code == 1 and "no built-in workload 'cifar-resnet'" in result.output


def test_an_optimizer_state_per_tensor_becomes_the_flat_parameters_state():
    """A checkpoint written when hivemind held one parameter per model tensor resumes on the one flat parameter:
    momentum joined in order, the epoch and the hyper-parameters kept; a flat state passes unchanged."""
    tensors = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((3, 2), (4,), (2, 2))]
    old = torch.optim.SGD(tensors, lr=0.5, momentum=0.9)
    for k, t in enumerate(tensors):
        t.grad = torch.full_like(t, float(k + 1))
    old.step()
    state = old.state_dict()
    state["state"]["local_epoch"] = 7  # as hivemind.Optimizer.state_dict adds it
    flat_state = flat_optimizer_state(state)
    flat = torch.nn.Parameter(torch.zeros(14))
    new = torch.optim.SGD([flat], lr=0.1, momentum=0.0)
    new.load_state_dict({**flat_state, "state": {k: v for k, v in flat_state["state"].items() if k != "local_epoch"}})
    expected = torch.cat([old.state[t]["momentum_buffer"].reshape(-1) for t in tensors])
    assert torch.equal(new.state[flat]["momentum_buffer"], expected)
    assert new.param_groups[0]["lr"] == 0.5 and new.param_groups[0]["momentum"] == 0.9
    assert flat_state["state"]["local_epoch"] == 7
    assert flat_optimizer_state(flat_state) is flat_state
    fresh = torch.optim.SGD(tensors, lr=0.5).state_dict()  # no momentum: no per-parameter state at all
    assert flat_optimizer_state(fresh) == {"state": {}, "param_groups": [{**fresh["param_groups"][0], "params": [0]}]}
