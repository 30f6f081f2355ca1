import inspect

import pytest
from gpuswarm.proto import api, models
from gpuswarm.proto.models import (
    Assignment,
    ContributionClaim,
    CreditAdjustment,
    GPUInfo,
    Heartbeat,
    JobSpec,
    NewOwner,
    NodeRegistration,
    Requirements,
    Resources,
    RoundReport,
    StopRule,
)
from gpuswarm.proto.strict import OwnerModel, close_key, error_details
from gpuswarm.proto.workloads import WORKLOADS, DigitsMLPParams, validate_hyperparameters
from pydantic import BaseModel, ValidationError

NODE = "0123456789abcdef"
JOB = "j-0123456789ab"


def spec(**kw) -> JobSpec:
    return JobSpec.model_validate({"workload": "digits-mlp"} | kw)


def assignment(**kw) -> Assignment:
    base = dict(assignment_id=1, job_id=JOB, node_id=NODE, state="active", job_state="running",
                spec={"workload": "digits-mlp"}, run_id="run", shard_index=0, num_shards=1)
    return Assignment.model_validate(base | kw)


def problems(model: type[BaseModel], data: object) -> dict[str, str]:
    """field path -> message of every validation error, in the words the API and the CLI print."""
    with pytest.raises(ValidationError) as caught:
        model.model_validate(data)
    return {d["field"]: d["message"] for d in error_details(caught.value)}


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
    {"training": {"mode": "async"}},
    {"training": {"inner_steps": 0}},
    {"training": {"inner_steps": "many"}},
    {"training": {"outer_learning_rate": 0}},
    {"training": {"outer_learning_rate": float("nan")}},
    {"training": {"outer_momentum": 1.0}},
    {"training": {"outer_momentum": -0.1}},
    {"training": {"compression": "4bit"}},
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


def test_unknown_keys_an_owner_sends_are_refused_but_a_relayed_spec_drops_them():
    # The owner's own spec is strict (proto.strict.OwnerModel): a typo must not be dropped silently.
    with pytest.raises(ValidationError, match="from_the_future"):
        spec(from_the_future=1)
    with pytest.raises(ValidationError, match="tpu_pods"):
        spec(requirements={"allow_cpu": False, "tpu_pods": 4})
    # Relayed by a newer coordinator (in a node's assignment), the keys this version does not know are dropped.
    relayed = spec().model_dump(mode="json") | {"from_the_future": 1}
    relayed["requirements"] = {"allow_cpu": False, "tpu_pods": 4}
    s = assignment(spec=relayed).spec
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


# ---------------------------------------------------------------------------------------------------- strict input


def test_owner_facing_models_are_strict_and_wire_models_are_not():
    owner_facing = {JobSpec, StopRule, Requirements, NewOwner, CreditAdjustment, models.BlobRef, models.CodeRef,
                    models.DatasetRef, models.TrainingOptions}
    strict = {cls for _, cls in inspect.getmembers(models, inspect.isclass)
              if issubclass(cls, BaseModel) and cls.__module__ == models.__name__ and issubclass(cls, OwnerModel)}
    assert strict == owner_facing
    assert all(issubclass(schema, OwnerModel) for schema in WORKLOADS.values())
    for cls in owner_facing | set(WORKLOADS.values()):
        assert cls.model_config["extra"] == "forbid" and cls.model_config["strict"] is True, cls


@pytest.mark.parametrize(("name", "known", "meant"), [
    ("budgett", ["budget", "max_nodes"], "budget"),
    ("max_node", ["min_nodes", "max_nodes"], "max_nodes"),
    ("max_epoch", ["target_accuracy", "max_epochs"], "max_epochs"),
    ("Budget", ["budget"], "budget"),
    ("hiden", list(DigitsMLPParams.model_fields), "hidden"),
    ("colour", ["budget", "max_nodes"], None),
    ("x", [], None),
])
def test_close_key(name, known, meant):
    assert close_key(name, known) == meant


def test_unknown_keys_are_named_with_the_key_meant_at_every_depth():
    found = problems(JobSpec, {"workload": "digits-mlp", "budgett": 5, "max_node": 3, "stop": {"max_epoch": 3},
                               "requirements": {"verified": True}, "hyperparameters": {"hiden": 64}})
    assert found == {
        "budgett": "unknown key; did you mean 'budget'?",
        "max_node": "unknown key; did you mean 'max_nodes'?",
        "stop.max_epoch": "unknown key; did you mean 'max_epochs'?",
        "requirements.verified": "unknown key; did you mean 'verified_only'?",
        "hyperparameters.hiden": "unknown key; did you mean 'hidden'?",
    }


def test_an_unknown_key_close_to_nothing_lists_the_known_ones():
    message = problems(JobSpec, {"workload": "digits-mlp", "colour": "red"})["colour"]
    assert message.startswith("unknown key; the known keys are ")
    assert all(key in message for key in JobSpec.model_fields)


def test_unknown_keys_and_other_errors_are_reported_together():
    found = problems(JobSpec, {"workload": "digits-mlp", "budgett": 5, "min_nodes": 0, "stop": {"max_epochs": "3"}})
    assert set(found) == {"budgett", "min_nodes", "stop.max_epochs"}
    assert found["stop.max_epochs"] == "Input should be a valid integer, got the string '3'"


@pytest.mark.parametrize(("kw", "field", "got"), [
    ({"max_nodes": "2"}, "max_nodes", "the string '2'"),
    ({"min_nodes": True}, "min_nodes", "the boolean true"),
    ({"max_nodes": 2.0}, "max_nodes", "the number 2.0"),
    ({"budget": "5"}, "budget", "the string '5'"),
    ({"budget": False}, "budget", "the boolean false"),
    ({"name": 7}, "name", "the number 7"),
    ({"stop": {"target_accuracy": "0.9"}}, "stop.target_accuracy", "the string '0.9'"),
    ({"requirements": {"verified_only": 1}}, "requirements.verified_only", "the number 1"),
    ({"requirements": {"verified_only": "true"}}, "requirements.verified_only", "the string 'true'"),
    ({"requirements": {"gpu_models": "A100"}}, "requirements.gpu_models", "the string 'A100'"),
    ({"hyperparameters": {"hidden": "64"}}, "hyperparameters.hidden", "the string '64'"),
    ({"hyperparameters": {"learning_rate": "0.1"}}, "hyperparameters.learning_rate", "the string '0.1'"),
])
def test_job_spec_takes_no_coerced_scalars(kw, field, got):
    message = problems(JobSpec, {"workload": "digits-mlp"} | kw)[field]
    assert message.endswith(f", got {got}"), message


def test_a_whole_number_is_a_fine_float():
    s = spec(budget=5, max_price_per_gpu_hour=1, requirements={"min_gpu_memory_gb": 8},
             hyperparameters={"learning_rate": 1})
    assert s.budget == 5.0 and isinstance(s.budget, float)
    assert s.max_price_per_gpu_hour == 1.0 and s.requirements.min_gpu_memory_gb == 8.0
    assert s.hyperparameters["learning_rate"] == 1.0


def test_a_stored_spec_reads_back_strictly():
    s = spec(budget=5, hyperparameters={"hidden": 64}, requirements={"gpu_models": ["A100"]})
    assert JobSpec.model_validate(s.model_dump(mode="json")) == s
    assert assignment(spec=s.model_dump(mode="json")).spec == s
    assert assignment(spec=s).spec == s


def test_relayed_spec_keeps_strict_types():
    with pytest.raises(ValidationError, match="max_nodes"):
        assignment(spec={"workload": "digits-mlp", "max_nodes": "2"})


def test_api_job_answer_reads_a_spec_this_version_does_not_know():
    """A newer coordinator's answer: an unknown workload, hyper-parameter and keys still read, and are kept."""
    answer = api.JobInfo.model_validate({
        "id": JOB, "name": "", "state": "pending", "created_at": 1.0, "owner_id": "o-1",
        "progress": {"epoch": 0.0, "global_step": 0, "samples_per_second": 0.0, "peers": 0},
        "spec": {"workload": "tinylm", "hyperparameters": {"layers": 4}, "priority": 3,
                 "stop": {"max_epochs": 5, "patience": 2}}})
    assert (answer.spec.workload, answer.spec.hyperparameters, answer.spec.stop.max_epochs) == ("tinylm",
                                                                                             {"layers": 4}, 5)
    assert answer.spec.model_dump()["priority"] == 3 and answer.spec.stop.model_dump()["patience"] == 2
    assert answer.spec.min_nodes == 1 and answer.spec.requirements.allow_cpu


def test_admin_requests_are_strict():
    assert problems(NewOwner, {"name": "ann", "credit": 5}) == {"credit": "unknown key; did you mean 'credits'?"}
    assert problems(NewOwner, {"name": "ann", "credits": "5"})["credits"].endswith("got the string '5'")
    assert problems(CreditAdjustment, {"amount": 5, "meno": "x"}) == {"meno": "unknown key; did you mean 'memo'?"}
    assert problems(CreditAdjustment, {"amount": True})["amount"].endswith("got the boolean true")
    assert NewOwner.model_validate({"name": "ann", "credits": 5}).credits == 5.0
    assert CreditAdjustment.model_validate({"amount": -3}).amount == -3.0


def test_workload_params_are_strict():
    with pytest.raises(ValidationError, match="batch_size"):
        DigitsMLPParams.model_validate({"batch_size": "32"})
    with pytest.raises(ValidationError, match="did you mean 'seed'"):
        validate_hyperparameters("digits-mlp", {"seeds": 1})
    assert validate_hyperparameters("digits-mlp", {"matchmaking_time": 2})["matchmaking_time"] == 2.0


def test_wire_messages_still_ignore_unknown_fields_and_coerce():
    # Nodes and the coordinator of mixed versions must still talk (STYLE.md #4): only owner input is strict.
    beat = Heartbeat.model_validate({"node_id": NODE, "state": "idle", "from_the_future": 1})
    assert not hasattr(beat, "from_the_future")
    reg = NodeRegistration.model_validate({"node_id": NODE, "software_version": "v", "new_field": [1],
                                           "resources": {"cpu_cores": "4", "ram_gb": 8, "tpu": 1}})
    assert reg.resources.cpu_cores == 4
    assert claim(samples="10", future=True).samples == 10


def test_error_details_strip_pydantic_prefixes():
    found = problems(JobSpec, {"workload": "resnet-9000"})
    assert found["workload"].startswith("unknown workload 'resnet-9000'")
    assert problems(JobSpec, {"workload": "digits-mlp", "min_nodes": 3, "max_nodes": 2})[""] == (
        "min_nodes (3) is greater than max_nodes (2)")


def test_training_mode_defaults_to_local_updates():
    options = spec().training
    assert (options.mode, options.inner_steps, options.outer_learning_rate, options.outer_momentum,
            options.compression) == ("diloco", None, 1.0, 0.0, "8bit")
    assert spec(training={"mode": "sync", "inner_steps": 8}).training.mode == "sync"


@pytest.mark.parametrize(("training", "expected"), [
    ({}, "8bit"),
    ({"mode": "diloco"}, "8bit"),
    ({"mode": "sync"}, "fp16"),  # every step's gradients: fp16 unless the owner asks
    ({"mode": "sync", "compression": "8bit"}, "8bit"),
    ({"mode": "diloco", "compression": "none"}, "none"),
])
def test_compression_defaults_by_mode_and_an_owners_choice_stands(training, expected):
    job = spec(training=training)
    assert job.training.compression == expected
    # What the coordinator stores and a node reads back is the same choice.
    assert JobSpec.model_validate_json(job.model_dump_json()).training.compression == expected


def test_a_federated_job_names_node_local_data_and_runs_its_own_code():
    code = {"sha256": "a" * 64, "size": 10, "format": "tar", "entrypoint": "pkg.mod:make"}
    job = JobSpec.model_validate({"code": code, "local_dataset": "clinic-a",
                                  "training": {"mode": "fedavg", "local_epochs": 2}})
    assert (job.local_dataset, job.training.mode, job.training.local_epochs, job.training.compression) == (
        "clinic-a", "fedavg", 2, "8bit")
    assert job.blob_refs() == [job.code]  # the dataset is no blob: nothing of it is uploaded
    refused = {
        "local_dataset (the nodes' own data) goes with the job's own code and no dataset": [
            {"workload": "digits-mlp", "local_dataset": "clinic-a"},
            {"code": code, "local_dataset": "clinic-a",
             "dataset": {"sha256": "b" * 64, "size": 1, "format": "file", "name": "d.npz"}}],
        'training mode "fedavg" is for node-local data: name it in local_dataset': [
            {"code": code, "training": {"mode": "fedavg"}}],
        'local_epochs is for training mode "fedavg"': [
            {"code": code, "local_dataset": "x", "training": {"local_epochs": 2}}],
    }
    for message, specs in refused.items():
        for bad in specs:
            assert problems(JobSpec, bad)[""] == message
    assert "local_dataset" in problems(JobSpec, {"code": code, "local_dataset": "../etc"})
    assert Resources.model_validate({"cpu_cores": 1, "ram_gb": 1}).datasets == []
