"""Hyper-parameter sweeps on the wire: what a job owner submits (`SweepSpec`) and what the coordinator answers.

A sweep is a search space over a job's hyper-parameters, a number of trials, the metric to optimise and a job spec
(the template). The coordinator samples each trial's values (Optuna, coordinator/search.py), runs each trial as an
ordinary job (its own nodes, budget escrow and ledger), reads the metric from the job's progress as it trains,
prunes the trials that fall behind, and keeps the best. Each parameter of the space names a key of the template's
`hyperparameters`; for a built-in workload every corner of the space (each bound, each choice) is checked against
the workload's schema at submit, so a space no trial could run is refused before anything starts.

Strict like every owner's model (`proto.strict.OwnerModel`). Pure pydantic: the job owner's CLI imports it.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from gpuswarm.proto.api import ApiModel
from gpuswarm.proto.models import JobSpec, MetricName
from gpuswarm.proto.strict import OwnerModel, error_details
from gpuswarm.proto.workloads import validate_hyperparameters
from pydantic import Field, StringConstraints, ValidationError, model_validator

SWEEP_ID_PATTERN = r"^s-[0-9a-f]{12}$"
ParamName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
Bound = Annotated[float, Field(ge=-1e15, le=1e15, allow_inf_nan=False)]
Choice = Annotated[str, StringConstraints(max_length=128)] | bool | int | Bound


class FloatParam(OwnerModel):
    """A float between `low` and `high` (inclusive), sampled on a log scale with `log = true`."""

    type: Literal["float"]
    low: Bound
    high: Bound
    log: bool = False

    @model_validator(mode="after")
    def _range(self) -> FloatParam:
        _check_range(self.low, self.high, self.log)
        return self


class IntParam(OwnerModel):
    """An integer between `low` and `high` (inclusive), sampled on a log scale with `log = true`."""

    type: Literal["int"]
    low: Annotated[int, Field(ge=-2**53, le=2**53)]
    high: Annotated[int, Field(ge=-2**53, le=2**53)]
    log: bool = False

    @model_validator(mode="after")
    def _range(self) -> IntParam:
        _check_range(self.low, self.high, self.log)
        return self


class CategoricalParam(OwnerModel):
    """One of `choices`."""

    type: Literal["categorical"]
    choices: list[Choice] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _distinct(self) -> CategoricalParam:
        if len({repr(c) for c in self.choices}) != len(self.choices):
            raise ValueError("choices repeat a value")
        return self


def _check_range(low: float, high: float, log: bool) -> None:
    if low >= high:
        raise ValueError(f"low ({low}) must be less than high ({high})")
    if log and low <= 0:
        raise ValueError(f"a log-scaled range needs low > 0, got {low}")


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class SamplerOptions(OwnerModel):
    """How trial values are chosen: Optuna's TPE (after `startup_trials` random ones) or plain random sampling."""

    kind: Literal["tpe", "random"] = "tpe"
    startup_trials: Annotated[int, Field(ge=1, le=1000)] | None = None  # None: a third of the trials, 2 to 10


class PrunerOptions(OwnerModel):
    """How trials that fall behind are stopped, on the job's training measured in `unit`: completed epochs (passes
    over the data: the same amount of training whatever a trial's batch size) or global steps.

    `asha`: asynchronous successive halving: at min_resource, min_resource * r, min_resource * r^2, ... units a
    trial goes on only if it is in the best 1/r of the trials that reached that point (r = reduction_factor).
    `median`: a trial past min_resource units stops when its value is worse than the median of the completed
    trials' values at that point. `none`: every trial runs to its stop rule."""

    kind: Literal["asha", "median", "none"] = "asha"
    unit: Literal["epoch", "step"] = "epoch"
    min_resource: Annotated[int, Field(ge=1, le=10**9)] = 1
    reduction_factor: Annotated[int, Field(ge=2, le=100)] = 3


class SweepSpec(OwnerModel):
    """What a job owner submits to POST /v1/sweeps. Each trial is `job` with the space's values in its
    hyperparameters; each escrows `job.budget`, so the sweep needs `trials * job.budget` credits at most."""

    name: Annotated[str, StringConstraints(max_length=128)] = ""
    metric: MetricName = "accuracy"
    direction: Literal["maximize", "minimize"] = "maximize"
    trials: Annotated[int, Field(ge=1, le=1000)]
    parallel: Annotated[int, Field(ge=1, le=256)] = 2  # trials running at once, each on its own nodes
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    space: dict[ParamName, Param] = Field(min_length=1, max_length=32)
    sampler: SamplerOptions = Field(default_factory=SamplerOptions)
    pruner: PrunerOptions = Field(default_factory=PrunerOptions)
    job: JobSpec

    @model_validator(mode="after")
    def _space_fits_the_job(self) -> SweepSpec:
        if self.job.workload is not None:  # owners' code checks its own params (the CLI and the node do)
            for values in corners(self.space):
                try:
                    validate_hyperparameters(self.job.workload, self.job.hyperparameters | values)
                except ValueError as e:
                    raise ValueError(f"the space does not fit workload {self.job.workload} at {values}: "
                                     f"{_first_line(e)}") from None
        return self

    @property
    def budget(self) -> float:
        """The most the sweep can spend: every trial's escrow."""
        return self.trials * self.job.budget


def corners(space: dict[str, FloatParam | IntParam | CategoricalParam]) -> list[dict[str, Any]]:
    """Values that between them take every bound and every choice of `space` (one dict per row, not the product)."""
    columns = {name: ([p.low, p.high] if not isinstance(p, CategoricalParam) else list(p.choices))
               for name, p in space.items()}
    rows = max(len(c) for c in columns.values())
    return [{name: c[min(i, len(c) - 1)] for name, c in columns.items()} for i in range(rows)]


def _first_line(error: ValueError) -> str:
    if isinstance(error, ValidationError):
        detail = error_details(error)[0]
        return f"{detail['field']}: {detail['message']}"
    return str(error)


# ---------------------------------------------------------------------------------------------------- answers


class SweepState(enum.StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"  # every trial ended and at least one completed
    FAILED = "failed"  # every trial ended and none completed
    CANCELLED = "cancelled"


class TrialState(enum.StrEnum):
    RUNNING = "running"
    COMPLETE = "complete"  # its job completed: `value` is the final model's metric
    PRUNED = "pruned"  # stopped early by the pruner: `value` is its last reported metric
    FAILED = "failed"  # its job failed (or could not be created)
    CANCELLED = "cancelled"  # its job was cancelled by its owner, or with the sweep


class BestTrial(ApiModel):
    number: int
    job_id: str
    value: float
    params: dict[str, Any]


class TrialInfo(ApiModel):
    number: int
    job_id: str | None = None
    state: TrialState
    params: dict[str, Any]
    value: float | None = None
    pruned_at_step: int | None = None  # in the pruner's unit
    reason: str | None = None
    curve: list[tuple[int, float]] = []  # (epoch or step, the pruner's unit; metric) as the job reported them


class SweepSummary(ApiModel):
    """One sweep of GET /v1/sweeps (POST /v1/sweeps answers it too, 201)."""

    id: str
    name: str
    state: SweepState
    metric: str
    direction: Literal["maximize", "minimize"]
    trials: int  # planned
    trials_done: int
    best_value: float | None = None
    best_trial: int | None = None
    created_at: float
    finished_at: float | None = None
    reason: str | None = None  # why it ended, when it did not simply complete


class SweepDetail(ApiModel):
    """GET /v1/sweeps/{sweep_id}: the summary's fields (with `trials` the list of every trial started so far, each
    with its curve, and `trials_planned` the count), the space and options, and the best trial."""

    id: str
    name: str
    state: SweepState
    metric: str
    direction: Literal["maximize", "minimize"]
    trials_planned: int
    trials_done: int
    best_value: float | None = None
    best_trial: int | None = None
    created_at: float
    finished_at: float | None = None
    reason: str | None = None  # why it ended, when it did not simply complete
    space: dict[str, Any]
    sampler: dict[str, Any]
    pruner: dict[str, Any]
    trials: list[TrialInfo]
    best: BestTrial | None = None


class SweepList(ApiModel):
    """GET /v1/sweeps: the owner's sweeps, newest first."""

    sweeps: list[SweepSummary]
