"""Sweeps: a hyperparameter search over a job spec, as POSTed to /v1/sweeps, and as the API shows it.

A sweep runs trials, each an ordinary job whose spec is `base` with the sampled values put at
the search space's dotted paths (`"optimizer.lr"`). Optuna samples them and prunes the trials
whose objective, reported as the job's metrics, falls behind.
"""

from __future__ import annotations

import math
from datetime import datetime
from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, model_validator

from api_schemas.api import JobStatus
from api_schemas.jobs import JobSpec, SpecModel, stored

Scalar = bool | int | float | str


class Dimension(SpecModel):
    """One field's values: exactly one of `choice`, `uniform`, `log_uniform` or `int_range`."""

    choice: list[Scalar] | None = Field(None, min_length=1, max_length=1000, description="One of these values.")
    uniform: tuple[float, float] | None = Field(None, description="A float in [low, high].")
    log_uniform: tuple[float, float] | None = Field(None, description="A float in [low, high], uniform in its logarithm (low > 0).")
    int_range: tuple[int, int] | None = Field(None, description="An integer in [low, high].")
    step: int | None = Field(None, ge=1, description="With `int_range`: only low, low + step, low + 2·step, …")

    @model_validator(mode="after")
    def _one_kind(self) -> Dimension:
        given = [name for name in ("choice", "uniform", "log_uniform", "int_range") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of choice, uniform, log_uniform, int_range")
        if self.step is not None and self.int_range is None:
            raise ValueError("step: only with int_range")
        bounds = self.uniform or self.log_uniform or self.int_range
        if bounds is not None:
            low, high = bounds
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise ValueError(f"{given[0]}: low must be below high, both finite")
            if self.log_uniform is not None and low <= 0:
                raise ValueError("log_uniform: low must be above 0")
        return self

    @property
    def grid_values(self) -> list[Scalar] | None:
        """Every value, for a grid; None for a continuous range."""
        if self.choice is not None:
            return list(self.choice)
        if self.int_range is not None:
            return list(range(self.int_range[0], self.int_range[1] + 1, self.step or 1))
        return None

    @property
    def extremes(self) -> list[Scalar]:
        """Values that, if a job spec takes them, it takes all of this dimension's (checked at submit)."""
        return self.choice or list(self.uniform or self.log_uniform or self.int_range)


class SamplerConfig(SpecModel):
    kind: Literal["grid", "random", "tpe"] = Field("tpe", description="`grid` tries every combination (discrete dimensions only).")
    seed: int = Field(0, ge=0, lt=2**31, description="The same seed and results suggest the same trials.")


class Objective(SpecModel):
    metric: str = Field("eval_loss", min_length=1, max_length=64, description="A metric the trials report; a trial's value is its last.")
    direction: Literal["min", "max"] = "min"


class Budget(SpecModel):
    max_trials: int = Field(ge=1, le=1000, description="Trials in all; a grid stops sooner when it has tried every combination.")
    max_concurrent: int = Field(1, ge=1, le=1000, description="Trials queued or running at once.")


class PrunerConfig(SpecModel):
    kind: Literal["none", "median", "asha"] = "none"
    min_steps: int = Field(100, ge=1, description="asha: the first rung, in steps (then × reduction_factor each); median: no pruning before this step.")
    reduction_factor: int = Field(3, ge=2, le=100, description="asha: a trial goes on past a rung if in the best 1/reduction_factor there.")
    startup_trials: int = Field(1, ge=0, description="median: no pruning until this many trials have finished.")


class SweepSpec(SpecModel):
    """A search: the job spec to start from, what to vary, how to choose, what to optimise, how much to spend."""

    name: str = Field(min_length=1, max_length=90, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Trials are named NAME-tN.")
    base: JobSpec = Field(description="The job spec each trial starts from; a trial's spec is validated as a job's.")
    search_space: dict[str, Dimension] = Field(
        min_length=1, max_length=64, description='Dotted paths into the job spec, e.g. `{"optimizer.lr": {"log_uniform": [1e-4, 1e-2]}}`.'
    )
    sampler: SamplerConfig = Field(default_factory=lambda: SamplerConfig())
    objective: Objective = Field(default_factory=lambda: Objective())
    budget: Budget
    pruner: PrunerConfig = Field(default_factory=lambda: PrunerConfig())

    @model_validator(mode="after")
    def _trials_can_tell(self, info: ValidationInfo) -> SweepSpec:
        """What no trial could search or report. (A sweep stored before these checks still reads.)"""
        if stored(info):
            return self
        if "name" in self.search_space:
            raise ValueError("search_space: `name` can't be searched: each trial is named NAME-tN")
        metric, built_in = self.objective.metric, self.base.script is None and self.base.model.kind != "custom"
        if built_in and metric not in self.base.reported_metrics() and not metric.startswith("sys/"):
            # Else every trial ran, none reported it, and the sweep "succeeded" with no best trial.
            raise ValueError(f"objective.metric: the built-in loop reports {', '.join(self.base.reported_metrics())} for this model, not {metric!r}")
        return self

    @model_validator(mode="after")
    def _grid_is_discrete(self) -> SweepSpec:
        if self.sampler.kind == "grid":
            if continuous := [path for path, dimension in self.search_space.items() if dimension.grid_values is None]:
                raise ValueError(f"sampler.kind: a grid needs choice or int_range dimensions; {', '.join(continuous)} is continuous")
        return self


class SweepStatus(str, Enum):
    running = "running"
    succeeded = "succeeded"  # every trial it was to run has ended
    failed = "failed"  # a suggested spec was refused: see failure_reason
    cancelled = "cancelled"

    @property
    def is_final(self) -> bool:
        return self != SweepStatus.running


class TrialOut(BaseModel):
    number: int = Field(description="0, 1, 2… in the order the sampler suggested them.")
    job_id: int
    params: dict[str, Scalar] = Field(description="The value at each of the search space's paths.")
    status: JobStatus
    step: int
    value: float | None = Field(description="The objective metric's last value; null before the trial reports it.")
    reason: str | None = Field(description="Why it ended other than succeeded (pruned: at which step).")


class SweepOut(BaseModel):
    id: int
    name: str
    owner: str
    status: SweepStatus
    failure_reason: str | None
    created_at: datetime
    finished_at: datetime | None
    spec: SweepSpec
    trials: list[TrialOut]
    best_trial: int | None = Field(description="Number of the finished trial with the best objective value.")
    best_spec: dict | None = Field(description="That trial's job spec, ready to submit to POST /v1/jobs.")


class SweepPage(BaseModel):
    items: list[SweepOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")
