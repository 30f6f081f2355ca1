"""The sweep's decisions, as pure functions over its trials so far: the next trial's values and whether a running
trial stops. Optuna makes both; the database stays the one record of a sweep.

Each call rebuilds an in-memory Optuna study from the trials (`TrialRecord`: values, state, the metric at each
reported step, the final value, and the pruner's own bookkeeping, `system_attrs`, which ASHA keeps per rung) and asks
it once. Nothing of Optuna's lives between calls, so any coordinator of the database can drive any sweep, a restart
loses nothing, and the same history gives the same answer: the sampler's seed is the sweep's seed and the trial's
number (a trial asked twice, after a crash between asking and recording, gets the same values). Rebuilding costs
little next to a trial (a few milliseconds for 100 trials with TPE).

Used by coordinator/sweeps.py, which reads and writes the trials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import optuna
from gpuswarm.proto.sweeps import CategoricalParam, FloatParam, IntParam, SweepSpec, TrialState
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState as OptunaState

optuna.logging.set_verbosity(optuna.logging.WARNING)  # not a line per rebuilt study

MEDIAN_STARTUP_TRIALS = 2  # median pruning starts once this many trials have completed
_STATES = {TrialState.RUNNING: OptunaState.RUNNING, TrialState.COMPLETE: OptunaState.COMPLETE,
           TrialState.PRUNED: OptunaState.PRUNED, TrialState.FAILED: OptunaState.FAIL,
           TrialState.CANCELLED: OptunaState.FAIL}


@dataclass(frozen=True)
class TrialRecord:
    """One trial as the sweep recorded it."""

    number: int
    state: TrialState
    params: dict[str, Any]
    intermediate: dict[int, float] = field(default_factory=dict)  # epoch or step (the pruner's unit) -> metric
    value: float | None = None  # the final metric (complete), else None
    system_attrs: dict[str, Any] = field(default_factory=dict)  # the pruner's bookkeeping (ASHA's rungs)


def distributions(spec: SweepSpec) -> dict[str, BaseDistribution]:
    out: dict[str, BaseDistribution] = {}
    for name, p in spec.space.items():
        if isinstance(p, FloatParam):
            out[name] = FloatDistribution(p.low, p.high, log=p.log)
        elif isinstance(p, IntParam):
            out[name] = IntDistribution(p.low, p.high, log=p.log)
        else:
            assert isinstance(p, CategoricalParam)
            out[name] = CategoricalDistribution(p.choices)
    return out


def startup_trials(spec: SweepSpec) -> int:
    """Random trials before TPE models the results: the spec's, else a third of the trials, from 2 to 10."""
    return spec.sampler.startup_trials or max(2, min(10, spec.trials // 3))


def _sampler(spec: SweepSpec, number: int) -> optuna.samplers.BaseSampler:
    seed = (spec.seed * 1_000_003 + number) % 2**32
    if spec.sampler.kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials(spec))


def _pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    options = spec.pruner
    if options.kind == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=options.min_resource,
                                                      reduction_factor=options.reduction_factor)
    if options.kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=MEDIAN_STARTUP_TRIALS, n_warmup_steps=options.min_resource)
    return optuna.pruners.NopPruner()


def _study(spec: SweepSpec, history: list[TrialRecord], number: int) -> optuna.Study:
    """An in-memory study holding `history` in order of trial number (the storage's trial ids are the indices)."""
    study = optuna.create_study(direction=spec.direction, sampler=_sampler(spec, number), pruner=_pruner(spec))
    dists = distributions(spec)
    for record in sorted(history, key=lambda r: r.number):
        state = _STATES[record.state]
        value = record.value if state == OptunaState.COMPLETE else None
        if state == OptunaState.COMPLETE and (value is None or not math.isfinite(value)):
            state = OptunaState.FAIL  # a completed job that never reported the metric teaches the sampler nothing
            value = None
        params = {k: v for k, v in record.params.items() if k in dists}
        study.add_trial(optuna.trial.create_trial(
            state=state, value=value, params=params, distributions={k: dists[k] for k in params},
            intermediate_values={s: v for s, v in record.intermediate.items() if math.isfinite(v)},
            system_attrs=record.system_attrs))
    return study


def suggest(spec: SweepSpec, history: list[TrialRecord], number: int) -> dict[str, Any]:
    """The values of trial `number`, given the trials before it (those still running included)."""
    study = _study(spec, [r for r in history if r.number != number], number)
    trial = study.ask(distributions(spec))
    return dict(trial.params)


def should_prune(spec: SweepSpec, history: list[TrialRecord], number: int) -> tuple[bool, dict[str, Any]]:
    """Whether running trial `number` (in `history`, with its latest metric) stops now, and its `system_attrs` after
    the pruner's bookkeeping (to record whatever the answer: ASHA counts a trial at each rung it reached)."""
    ordered = sorted(history, key=lambda r: r.number)
    index = next(i for i, r in enumerate(ordered) if r.number == number)
    study = _study(spec, ordered, number)
    pruned = study.pruner.prune(study, study.trials[index])
    return bool(pruned), dict(study.trials[index].system_attrs)


def best(direction: str, history: list[TrialRecord]) -> TrialRecord | None:
    """The completed trial with the best final metric (the first of equals) when the sweep goes in `direction`
    ("maximize" or "minimize"), or None."""
    done = [r for r in history if r.state == TrialState.COMPLETE and r.value is not None and math.isfinite(r.value)]
    if not done:
        return None
    sign = 1 if direction == "maximize" else -1
    return max(sorted(done, key=lambda r: r.number), key=lambda r: sign * r.value)
