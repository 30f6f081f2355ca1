"""The sweep's decisions (coordinator/search.py), property-tested over random spaces and histories: values inside
the space, the same answer for the same history, pruning only past the first rung, and the best trial."""

from __future__ import annotations

import math
import re

import pytest
from gpuswarm.coordinator.search import TrialRecord, best, should_prune, suggest
from gpuswarm.proto.sweeps import CategoricalParam, FloatParam, IntParam, SweepSpec, TrialState
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

JOB = {"code": {"sha256": "0" * 64, "size": 1, "format": "tar", "entrypoint": "pkg.mod:make"}}


@st.composite
def params(draw):
    kind = draw(st.sampled_from(["float", "int", "categorical"]))
    if kind == "categorical":
        return {"type": kind, "choices": draw(st.lists(st.integers(-5, 5) | st.text(max_size=4), min_size=1,
                                                        max_size=5, unique_by=repr))}
    log = draw(st.booleans())
    low = draw(st.integers(1, 50) if kind == "int" else st.floats(1e-6, 10.0) if log else st.floats(-10.0, 10.0))
    span = draw(st.integers(1, 500) if kind == "int" else st.floats(1e-3, 100.0))
    return {"type": kind, "low": low, "high": low + span, "log": log}


spaces = st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), params(), min_size=1, max_size=4)


def spec_of(space: dict, **extra) -> SweepSpec:
    return SweepSpec.model_validate({"trials": 20, "space": space, "job": JOB} | extra)


def inside(spec: SweepSpec, values: dict) -> bool:
    for name, p in spec.space.items():
        v = values[name]
        if isinstance(p, CategoricalParam):
            if v not in p.choices:
                return False
        elif isinstance(p, IntParam):
            if not (isinstance(v, int) and p.low <= v <= p.high):
                return False
        else:
            assert isinstance(p, FloatParam)
            if not (p.low <= v <= p.high):
                return False
    return set(values) == set(spec.space)


@settings(max_examples=40, deadline=None)
@given(spaces, st.sampled_from(["tpe", "random"]), st.integers(0, 2**31 - 1), st.lists(st.floats(0, 1), max_size=8))
def test_values_lie_in_the_space_and_the_same_history_gives_the_same_values(space, sampler, seed, results):
    spec = spec_of(space, sampler={"kind": sampler, "startup_trials": 2}, seed=seed)
    history: list[TrialRecord] = []
    for number, result in enumerate(results):
        values = suggest(spec, history, number)
        assert inside(spec, values), values
        assert suggest(spec, history, number) == values  # asked again after a crash: the same trial
        history.append(TrialRecord(number, TrialState.COMPLETE, values, {1: result}, result))
    assert inside(spec, suggest(spec, history, len(history)))


def test_trials_started_together_get_different_values():
    spec = spec_of({"x": {"type": "float", "low": 0.0, "high": 1.0}})
    first = suggest(spec, [], 0)
    second = suggest(spec, [TrialRecord(0, TrialState.RUNNING, first)], 1)
    assert first != second


def curve(values: list[float]) -> dict[int, float]:
    return dict(enumerate(values, start=1))


@pytest.mark.parametrize("kind", ["asha", "median"])
def test_a_trial_is_never_pruned_before_the_first_rung(kind):
    spec = spec_of({"x": {"type": "float", "low": 0.0, "high": 1.0}}, pruner={"kind": kind, "min_resource": 3})
    done = [TrialRecord(i, TrialState.COMPLETE, {"x": 0.5}, curve([0.9] * 6), 0.9) for i in range(3)]
    for step in (1, 2):
        trial = TrialRecord(3, TrialState.RUNNING, {"x": 0.1}, curve([0.01] * step))
        assert should_prune(spec, [*done, trial], 3)[0] is False


@pytest.mark.parametrize("kind", ["asha", "median"])
def test_the_worst_trial_at_a_rung_is_pruned_and_the_best_goes_on(kind):
    spec = spec_of({"x": {"type": "float", "low": 0.0, "high": 1.0}}, pruner={"kind": kind, "min_resource": 1})
    history: list[TrialRecord] = []
    for number, level in enumerate([0.8, 0.7, 0.9]):  # three trials ran to the end, recording their rungs
        record = TrialRecord(number, TrialState.RUNNING, {"x": level}, {})
        for step in range(1, 10):
            record = TrialRecord(number, TrialState.RUNNING, record.params, record.intermediate | {step: level},
                                 None, record.system_attrs)
            _, attrs = should_prune(spec, [*history, record], number)
            record = TrialRecord(number, TrialState.RUNNING, record.params, record.intermediate, None, attrs)
        history.append(TrialRecord(number, TrialState.COMPLETE, record.params, record.intermediate, level,
                                   record.system_attrs))
    bad = TrialRecord(3, TrialState.RUNNING, {"x": 0.1}, {1: 0.1, 2: 0.1, 3: 0.1})
    good = TrialRecord(4, TrialState.RUNNING, {"x": 0.95}, {1: 0.95, 2: 0.95, 3: 0.95})
    assert should_prune(spec, [*history, bad], 3)[0] is True
    assert should_prune(spec, [*history, good], 4)[0] is False


def test_none_never_prunes():
    spec = spec_of({"x": {"type": "float", "low": 0.0, "high": 1.0}}, pruner={"kind": "none"})
    done = [TrialRecord(i, TrialState.COMPLETE, {"x": 0.5}, curve([0.9] * 6), 0.9) for i in range(3)]
    assert should_prune(spec, [*done, TrialRecord(3, TrialState.RUNNING, {"x": 0}, curve([0.0] * 6))], 3)[0] is False


@given(st.lists(st.tuples(st.sampled_from(list(TrialState)), st.floats(-1e6, 1e6)), max_size=12),
       st.sampled_from(["maximize", "minimize"]))
def test_the_best_is_the_best_completed_value(trials, direction):
    spec = spec_of({"x": {"type": "float", "low": 0.0, "high": 1.0}}, direction=direction)
    history = [TrialRecord(i, state, {"x": 0.5}, {}, value if state == TrialState.COMPLETE else None)
               for i, (state, value) in enumerate(trials)]
    found = best(spec.direction, history)
    values = [v for s, v in trials if s == TrialState.COMPLETE]
    if not values:
        assert found is None
    else:
        assert found.state == TrialState.COMPLETE
        assert found.value == (max(values) if direction == "maximize" else min(values))
        assert not math.isnan(found.value)


@pytest.mark.parametrize(("space", "message"), [
    ({"x": {"type": "float", "low": 1.0, "high": 1.0}}, "low (1.0) must be less than high (1.0)"),
    ({"x": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}, "a log-scaled range needs low > 0"),
    ({"x": {"type": "categorical", "choices": [1, 1]}}, "choices repeat a value"),
    ({"x": {"type": "uniform", "low": 0, "high": 1}}, "type"),
    ({"hidden": {"type": "int", "low": 2, "high": 64}}, "does not fit workload digits-mlp"),
    ({"hiden": {"type": "int", "low": 16, "high": 64}}, "does not fit workload digits-mlp"),
])
def test_a_space_no_trial_could_run_is_refused(space, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        SweepSpec.model_validate({"trials": 4, "space": space, "job": {"workload": "digits-mlp"}})
