"""End to end: a hyper-parameter sweep on a real coordinator and two real node daemons.

`gpuswarm sweep submit` posts examples/sweep/sweep.toml (5 trials of digits-mlp, 2 at a time, ASHA on epochs); each
trial trains as its own job on one node; the coordinator prunes the trials that fall behind at a rung, and the best
completed trial's model downloads with `gpuswarm sweep download` and scores what its node reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from gpuswarm.node.workloads.saved import evaluate_builtin, read_model_file
from localswarm import LocalSwarm

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).parents[2] / "examples" / "sweep" / "sweep.toml"
TRIALS = 5
EPOCHS = 4


@pytest.fixture
def swarm(swarm_lab) -> LocalSwarm:
    lab = swarm_lab()
    lab.start_coordinator()
    for i in range(2):
        lab.start_node(i)
    lab.wait_for_nodes(2)
    return lab


def cli(lab: LocalSwarm, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "gpuswarm.cli", *args, "-c", lab.url, "--token",
                             lab.client.token], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_a_sweep_prunes_trials_and_keeps_the_best(swarm, tmp_path):
    sweep_file = tmp_path / "sweep.toml"
    # Four epochs still pass both of ASHA's rungs (1 and 3); the example's eight took half the test's time.
    sweep_file.write_text(EXAMPLE.read_text().replace("trials = 12", f"trials = {TRIALS}")
                          .replace("max_epochs = 8", f"max_epochs = {EPOCHS}"))
    sweep = tomllib.loads(sweep_file.read_text())
    assert (sweep["trials"], sweep["job"]["stop"]["max_epochs"]) == (TRIALS, EPOCHS)
    sweep_id = json.loads(cli(swarm, "sweep", "submit", str(sweep_file), "--json"))["id"]

    deadline = time.monotonic() + 600
    while (sweep := swarm.client.sweep(sweep_id)).state == "running":
        assert time.monotonic() < deadline, f"the sweep is still running: {sweep.trials}"
        time.sleep(2)
    assert sweep.state == "completed", sweep
    states = [t.state for t in sweep.trials]
    assert len(states) == TRIALS and "pruned" in states and "complete" in states, sweep.trials

    # Every trial reported a curve by epoch; a pruned one stopped at its first point past a rung (ASHA's first is
    # one epoch) with that point's value.
    for t in sweep.trials:
        assert t.curve and all(0 <= v <= 1 for _, v in t.curve), t
        if t.state == "pruned":
            assert t.pruned_at_step >= 1 and (t.pruned_at_step, t.value) == tuple(t.curve[-1])
            assert swarm.client.job(t.job_id).state == "cancelled"

    # The best is the best final value reported, and its job is an ordinary completed job with a model.
    complete = {t.number: t.value for t in sweep.trials if t.state == "complete"}
    assert sweep.best is not None and sweep.best.value == max(complete.values())
    assert complete[sweep.best.number] == sweep.best.value and sweep.best_trial == sweep.best.number
    job = swarm.client.job(sweep.best.job_id)
    assert job.state == "completed" and job.final_accuracy == pytest.approx(sweep.best.value)
    assert {k: job.spec.hyperparameters[k] for k in sweep.best.params} == sweep.best.params

    out = tmp_path / "best.pt"
    cli(swarm, "sweep", "download", sweep_id, "--output", str(out))
    accuracy = evaluate_builtin(read_model_file(out))["accuracy"]
    assert accuracy == pytest.approx(sweep.best.value, abs=1e-6)

    table = cli(swarm, "sweep", "status", sweep_id)
    assert f"best: trial {sweep.best.number}" in table and "pruned" in table
