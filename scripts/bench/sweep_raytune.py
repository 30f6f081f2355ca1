"""Baseline for docs/benchmarks.md: the digits-mlp hyper-parameter sweep done with Ray Tune on this one machine.

The same search space, trial count and workload as the product's sweep: scikit-learn's 8x8 digits with the fixed
test split and the MLP of `gpuswarm.node.workloads.digits`, trained with Adam for up to --epochs passes over the
training split, test accuracy reported after each (the step axis is the epoch), maximised. ASHA
(grace_period 1, reduction_factor 3, as examples/sweep/sweep.toml) stops the weak trials early; Optuna's TPE (seed
0, 4 random trials first, as the product's default for 12) proposes the trials, or Ray's random search when Optuna
is not installed (the output says which). Two trials run at a time, one torch
thread each; every trial's weights and batch order are seeded with 0.

Ray stays out of .venv; it has a venv of its own, created from the checkout's root with:

    python3 -m venv .venv-ray
    .venv-ray/bin/python -m pip install torch==2.13.0
    .venv-ray/bin/python -m pip install numpy scikit-learn pydantic cryptography optuna "ray[tune]==2.60.0"
    .venv-ray/bin/python -m pip install --no-deps -e .

Run: .venv-ray/bin/python scripts/bench/sweep_raytune.py [--trials N] [--epochs E] [--json]. Prints a table, or
with --json one line: best accuracy and parameters, trials ASHA stopped early, epochs trained in all, and the
seconds of `ray.init` (init_seconds) and of the sweep itself (wall_seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import tempfile
import time

import ray
import torch
from gpuswarm.node.workloads.digits import build_mlp, digits_split
from ray import tune
from ray.tune.schedulers import ASHAScheduler

CONCURRENCY = 2
SEED = 0
STARTUP = 4
SPACE = {
    "learning_rate": tune.loguniform(1e-4, 0.3),
    "hidden": tune.lograndint(16, 257),  # upper bound exclusive: 16..256
    "batch_size": tune.choice([16, 32, 64, 128]),
}


def train_digits(config: dict) -> None:
    """One trial: train the MLP for config["epochs"] epochs, reporting test accuracy after each."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    x_train, x_test, y_train, y_test = (torch.from_numpy(a.copy()) for a in digits_split())
    model = build_mlp(config["hidden"])
    optimizer = torch.optim.Adam(model.parameters(), lr=config["learning_rate"])
    order = torch.Generator().manual_seed(SEED)
    for _ in range(config["epochs"]):
        model.train()
        for idx in torch.randperm(len(x_train), generator=order).split(config["batch_size"]):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        tune.report({"accuracy": accuracy})


def search_algorithm() -> tuple[str, object | None]:
    """Optuna's TPE where Optuna is installed, else None: the Tuner's default, random search."""
    if importlib.util.find_spec("optuna") is None:
        return "random", None
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    # As the product's sweep samples 12 trials: 4 random ones first (a third of the trials), then TPE.
    return "optuna-tpe", OptunaSearch(sampler=optuna.samplers.TPESampler(seed=SEED, n_startup_trials=STARTUP))


def sweep(trials: int, epochs: int) -> tuple[dict, list[dict]]:
    """The summary and, best first, each trial's parameters, epochs trained and last accuracy."""
    started = time.perf_counter()
    ray.init(num_cpus=CONCURRENCY, include_dashboard=False, log_to_driver=False)
    init_seconds = time.perf_counter() - started
    search, algorithm = search_algorithm()
    with tempfile.TemporaryDirectory() as storage:
        tuner = tune.Tuner(
            tune.with_resources(train_digits, {"cpu": 1}),
            param_space={**SPACE, "epochs": epochs},
            tune_config=tune.TuneConfig(
                metric="accuracy", mode="max", num_samples=trials, max_concurrent_trials=CONCURRENCY,
                search_alg=algorithm,
                scheduler=ASHAScheduler(max_t=epochs, grace_period=1, reduction_factor=3)),
            run_config=tune.RunConfig(storage_path=storage, verbose=0))
        started = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # Tune's progress output: stdout keeps only the result
            results = tuner.fit()
        wall_seconds = time.perf_counter() - started
    ray.shutdown()
    if results.errors:
        raise RuntimeError(f"{len(results.errors)} trial(s) failed: {results.errors[0]}")
    best = results.get_best_result()
    trained = [r.metrics["training_iteration"] for r in results]
    summary = {
        "tool": "ray-tune", "ray_version": ray.__version__, "search": search, "scheduler": "asha",
        "trials": len(results), "pruned": sum(n < epochs for n in trained),
        "best_accuracy": best.metrics["accuracy"],
        "best_params": {k: best.config[k] for k in SPACE},
        "wall_seconds": round(wall_seconds, 2), "init_seconds": round(init_seconds, 2),
        "total_epochs_trained": sum(trained),
    }
    per_trial = [{**{k: r.config[k] for k in SPACE}, "epochs": r.metrics["training_iteration"],
                  "accuracy": r.metrics["accuracy"]} for r in results]
    return summary, sorted(per_trial, key=lambda t: -t["accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one line of JSON")
    args = parser.parse_args()
    summary, per_trial = sweep(args.trials, args.epochs)
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{'learning_rate':>13} {'hidden':>6} {'batch':>5} {'epochs':>6} {'accuracy':>8}")
    for t in per_trial:
        print(f"{t['learning_rate']:13.2e} {t['hidden']:6d} {t['batch_size']:5d} {t['epochs']:6d} {t['accuracy']:8.4f}")
    for key, value in summary.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
