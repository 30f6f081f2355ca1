"""The trusted side of the split with a real trainer process: a built-in workload run unsandboxed (as on a node
without bubblewrap), and the rule that owners' code is never run that way."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gpuswarm.node import runner as runner_module
from gpuswarm.node.local_updates import LocalUpdates
from gpuswarm.node.runner import JobRunner
from gpuswarm.node.trainer_link import Inputs, Settings, TrainerFailed, TrainerLink
from gpuswarm.node.worker import SharedParams
from gpuswarm.node.workloads.saved import read_model_file
from gpuswarm.proto.models import Assignment, JobSpec


def test_a_builtin_trains_saves_and_reports_through_an_unsandboxed_trainer(tmp_path):
    spec = JobSpec.model_validate({"workload": "digits-mlp", "stop": {"max_steps": 3}})
    link = TrainerLink(tmp_path / "job", Settings(sandboxed=False, answer_timeout=60))
    try:
        hello = link.start(spec.model_dump(mode="json"), Inputs(), gpus=[], threads=1, nice=0)
        assert hello.optimizer.name == "adam" and hello.devices == ["cpu"] and "accuracy" in hello.metrics
        shared = SharedParams(link)
        shared.bind_grads()  # mode "sync": the optimizer reads the gradients from the shared copy
        before = [p.detach().clone() for p in shared.params]
        optimizer = hello.optimizer.build([shared.flat])  # as hivemind gets it: one flat parameter
        for step in range(8):
            done = link.request("step", "step", "a step", version=shared.version, index=0, count=1, step=0,
                                resume=None)
            assert done.samples == hello.batch_size and done.position.batches == step + 1
            shared.take_grads()
            optimizer.step()
            shared.publish()
        assert any(not torch.equal(a, b) for a, b in zip(before, shared.params, strict=True))
        metrics = link.request("evaluate", "metrics", "evaluating", version=shared.version).metrics
        assert metrics["accuracy"] > hello.metrics["accuracy"]  # the trainer evaluated the worker's parameters
        link.request("save_model", "saved", "saving", version=shared.version, name="model.pt", metrics=metrics,
                     metadata={"global_step": 8})
        saved = read_model_file(link.box / "model.pt")
        assert saved.workload == "digits-mlp" and saved.metrics == metrics
        named = dict(zip([p.name for p in hello.params], shared.params, strict=True))
        assert all(torch.equal(saved.state_dict[name], param.detach()) for name, param in named.items())
    finally:
        link.close()
    assert link.proc.returncode == 0  # asked to stop, it stopped


def test_the_trainer_takes_inner_steps_itself_and_hands_its_parameters_back(tmp_path):
    spec = JobSpec.model_validate({"workload": "digits-mlp", "training": {"mode": "diloco"}})
    link = TrainerLink(tmp_path / "job", Settings(sandboxed=False, answer_timeout=60))
    try:
        hello = link.start(spec.model_dump(mode="json"), Inputs(), gpus=[], threads=1, nice=0)
        shared = SharedParams(link)
        local = LocalUpdates([shared.flat])
        done = link.request("inner", "inner", "inner steps", version=shared.version, steps=10, seconds=60.0, index=0,
                            count=1, step=0, resume=None)
        assert (done.steps, done.samples, done.position.batches) == (10, 10 * hello.batch_size, 10)
        shared.take_inner(local)
        assert all(not torch.equal(a.reshape(-1), b) for a, b in zip(shared.params, local.flat.split(shared.sizes),
                                                                     strict=True))  # every tensor moved
        # A request ends after its time budget (here none: one step), and the stream goes on where it was.
        done = link.request("inner", "inner", "inner steps", version=shared.version, steps=1000, seconds=0.0,
                            index=0, count=1, step=0, resume=None)
        assert (done.steps, done.position.batches) == (1, 11)
        # The swarm's parameters (here still the initial ones) replace the trainer's inner ones when published.
        shared.publish()
        metrics = link.request("evaluate", "metrics", "evaluating", version=shared.version).metrics
        assert metrics == hello.metrics
        with torch.no_grad():
            link.out.tensor[3] = float("nan")
        with pytest.raises(TrainerFailed, match="not finite"):
            shared.take_inner(local)
    finally:
        link.close()


def test_owners_code_is_refused_where_the_node_cannot_sandbox(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module.sandbox, "unavailable_reason", lambda: "bubblewrap (bwrap) is not installed")
    job_runner = JobRunner(tmp_path / "jobs", "127.0.0.1", lambda *_: None, signer=lambda payload: None)
    assignment = Assignment.model_validate({
        "assignment_id": 1, "job_id": "j-" + "a" * 12, "node_id": "b" * 16, "state": "active", "job_state": "running",
        "run_id": "run", "shard_index": 0,
        "num_shards": 1, "initial_peers": [], "spec": {
            "code": {"sha256": "0" * 64, "size": 1, "format": "tar", "entrypoint": "pkg:Work"}}})
    with pytest.raises(OSError, match="does not run job owners' code without a sandbox: bubblewrap"):
        asyncio.run(job_runner.start(assignment))
    builtin = assignment.model_copy(update={"spec": JobSpec.model_validate({"workload": "digits-mlp"})})
    assert "--no-sandbox" in job_runner._sandbox_args(builtin.spec)  # a built-in still runs, unsandboxed
