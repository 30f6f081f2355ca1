import pytest
from gpuswarm.proto.models import (
    ContributionClaim,
    GPUInfo,
    JobSpec,
    Requirements,
    Resources,
    RoundReport,
    StopRule,
)
from gpuswarm.proto.workloads import DigitsMLPParams, validate_hyperparameters
from pydantic import ValidationError

NODE = "0123456789abcdef"
JOB = "j-0123456789ab"


def spec(**kw) -> JobSpec:
    return JobSpec.model_validate({"workload": "digits-mlp"} | kw)


def claim(**kw) -> ContributionClaim:
    base = dict(job_id=JOB, node_id=NODE, epoch=0, samples=10, steps=1, compute_seconds=1.5,
                window_start=100.0, window_end=200.0)
    return ContributionClaim.model_validate(base | kw)


def test_job_spec_fills_hyperparameter_defaults():
    s = spec(hyperparameters={"hidden": 64})
    assert s.hyperparameters == DigitsMLPParams(hidden=64).model_dump()
    assert s.hyperparameters["hidden"] == 64
    assert s.hyperparameters["learning_rate"] == DigitsMLPParams.model_fields["learning_rate"].default
    assert spec().hyperparameters == DigitsMLPParams().model_dump()


def test_job_spec_rejects_unknown_workload():
    with pytest.raises(ValidationError, match="unknown workload"):
        spec(workload="resnet-9000")


def test_job_spec_rejects_unknown_hyperparameter():
    with pytest.raises(ValidationError, match="hiden"):
        spec(hyperparameters={"hiden": 64})


def test_validate_hyperparameters_rejects_unknown_workload():
    with pytest.raises(ValueError):
        validate_hyperparameters("nope", {})


def test_job_spec_rejects_min_nodes_above_max_nodes():
    with pytest.raises(ValidationError, match="min_nodes"):
        spec(min_nodes=3, max_nodes=2)
    assert spec(min_nodes=2, max_nodes=2).min_nodes == 2


@pytest.mark.parametrize("kw", [
    {"max_price_per_gpu_hour": float("nan")},
    {"max_price_per_gpu_hour": float("inf")},
    {"max_price_per_gpu_hour": -1.0},
    {"requirements": {"min_gpu_memory_gb": -1.0}},
    {"requirements": {"min_gpu_memory_gb": float("nan")}},
    {"hyperparameters": {"learning_rate": float("inf")}},
    {"hyperparameters": {"learning_rate": float("nan")}},
    {"hyperparameters": {"batch_size": 0}},
    {"stop": {"target_accuracy": float("nan")}},
    {"stop": {"target_accuracy": 1.5}},
    {"stop": {"max_epochs": 0}},
    {"min_nodes": 0},
])
def test_job_spec_rejects_out_of_bounds_values(kw):
    with pytest.raises(ValidationError):
        spec(**kw)


def test_stop_rule_needs_a_target_or_epochs():
    with pytest.raises(ValidationError, match="stop rule"):
        StopRule(target_accuracy=None, max_epochs=None)
    with pytest.raises(ValidationError):
        spec(stop={"target_accuracy": None, "max_epochs": None})
    assert StopRule(target_accuracy=0.9, max_epochs=None).target_accuracy == 0.9
    assert StopRule().max_epochs == 20


def test_unknown_top_level_and_nested_fields_are_ignored():
    s = spec(from_the_future=1, requirements={"allow_cpu": False, "tpu_pods": 4})
    assert not hasattr(s, "from_the_future")
    assert s.requirements == Requirements(allow_cpu=False)
    assert "from_the_future" not in s.model_dump()


def test_job_spec_is_immutable():
    s = spec()
    with pytest.raises(ValidationError):
        s.min_nodes = 5


def test_claim_rejects_window_end_before_start():
    with pytest.raises(ValidationError, match="window_end"):
        claim(window_start=200.0, window_end=100.0)
    assert claim(window_start=100.0, window_end=100.0).window_end == 100.0


@pytest.mark.parametrize("kw", [
    {"samples": -1}, {"steps": -1}, {"epoch": -1}, {"compute_seconds": -0.1}, {"compute_seconds": float("nan")},
    {"window_start": float("inf"), "window_end": float("inf")}, {"node_id": "not-a-node"}, {"job_id": "j-xyz"},
])
def test_claim_rejects_bad_values(kw):
    with pytest.raises(ValidationError):
        claim(**kw)


def test_resources_gpu_count_and_max_memory():
    res = Resources(cpu_cores=8, ram_gb=32, gpus=[GPUInfo(model="A100", memory_gb=40, count=2),
                                                  GPUInfo(model="H100", memory_gb=80)])
    assert res.gpu_count == 3
    assert res.max_gpu_memory_gb == 80
    cpu = Resources(cpu_cores=4, ram_gb=8)
    assert cpu.gpu_count == 0
    assert cpu.max_gpu_memory_gb == 0.0


@pytest.mark.parametrize("gpu", [{"model": "X", "memory_gb": 0}, {"model": "X", "memory_gb": 8, "count": 0},
                                 {"model": "", "memory_gb": 8}])
def test_gpu_info_bounds(gpu):
    with pytest.raises(ValidationError):
        GPUInfo.model_validate(gpu)


@pytest.mark.parametrize("kw", [{"claims": []}, {"claims": [{}] * 65}, {"epoch": -1}, {"node_id": "x"}])
def test_round_report_rejects_bad_values(kw):
    base = dict(job_id=JOB, node_id=NODE, epoch=3, claims=[{"kind": "claim"}])
    with pytest.raises(ValidationError):
        RoundReport.model_validate(base | kw)


@pytest.mark.parametrize("kw", [{"budget": -1}, {"budget": float("inf")}, {"gpus_per_node": 0},
                                {"gpus_per_node": 65}, {"max_price_per_gpu_hour": float("nan")}])
def test_job_spec_rejects_bad_market_fields(kw):
    with pytest.raises(ValidationError):
        spec(**kw)
