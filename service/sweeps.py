"""The sweep controller: asks Optuna for trials, submits them as jobs, and prunes the ones falling behind.

It runs in the scheduler's loop, once a pass for each running sweep. There is no Optuna storage:
each time, the study is rebuilt in memory from the sweep's trial jobs (their params, Optuna's
per-trial attributes such as a pruner's rungs, the objective metric as intermediate values, and
their statuses). So the service's database stays the one source of truth, on SQLite as on
PostgreSQL, with no second engine or tables of Optuna's own, and a restarted scheduler simply
rebuilds the same study. A trial's job is inserted with its number (unique per sweep) under the
sweep's lock, so a pass that dies half-way leaves either the trial or nothing, and the next one
goes on from there.

Pruning replays each new objective point through Optuna's `report`/`should_prune`, in step order,
whenever the pass comes, so the decisions do not depend on how often passes run.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import TYPE_CHECKING

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobSpec, JobStatus, SweepSpec, SweepStatus
from service.admission import Refused, admit
from service.db import state
from service.db.jobs import TrialOf
from service.db.models import Job, Sweep
from service.db.sweeps import finish_sweep, lock_sweep, objective_series, running_sweep_ids, trial_jobs
from common.settings import Settings
from service.sweep_space import distributions, grid, grid_size, with_params

if TYPE_CHECKING:
    import optuna
    from optuna.trial import TrialState

log = logging.getLogger("trainyard.sweeps")

# A final job's trial state in Optuna, by TrialState's name.
FINAL_TRIAL_STATE = {
    JobStatus.succeeded: "COMPLETE",
    JobStatus.pruned: "PRUNED",
    JobStatus.failed: "FAIL",
    JobStatus.cancelled: "FAIL",
}


def _optuna():
    """Optuna, imported at the first sweep's pass: it takes ~0.4 s of CPU to import, which every
    scheduler start paid though most never run a sweep."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def advance_sweeps(sessions: sessionmaker, settings: Settings) -> None:
    """One controller pass over every running sweep; one sweep's error doesn't hold up the others."""
    with sessions() as session:
        sweep_ids = running_sweep_ids(session)
    for sweep_id in sweep_ids:
        try:
            with sessions() as session:
                advance_sweep(session, sweep_id, settings)
        except Exception:
            log.exception("sweep %s: controller pass failed; the next pass retries", sweep_id)


def advance_sweep(session: Session, sweep_id: int, settings: Settings) -> None:
    """Prune what falls behind, then submit trials while the budget allows, or end the sweep."""
    sweep, _ = lock_sweep(session, sweep_id)
    if sweep.status != SweepStatus.running:
        session.rollback()
        return
    spec = SweepSpec.from_stored(sweep.spec)
    jobs = trial_jobs(session, [sweep.id])[sweep.id]
    study = _rebuilt_study(session, spec, jobs)
    session.commit()  # the prunings and the trials' replayed attributes

    wanted = spec.budget.max_trials if spec.sampler.kind != "grid" else min(spec.budget.max_trials, grid_size(spec.search_space))
    active = sum(not job.status.is_final for job in jobs)
    if len(jobs) >= wanted and not active:
        finish_sweep(session, sweep, SweepStatus.succeeded)
        session.commit()
        log.info("sweep %s: all %s trials ended", sweep.id, len(jobs))
        return
    number = len(jobs)
    while number < wanted and active < spec.budget.max_concurrent:
        sweep, count = lock_sweep(session, sweep.id)
        if sweep.status != SweepStatus.running or count != number:  # cancelled, or another scheduler added one
            session.rollback()
            return
        if not _submit_trial(session, sweep, spec, study, number, settings):
            return
        number, active = number + 1, active + 1


def _submit_trial(session: Session, sweep: Sweep, spec: SweepSpec, study: optuna.Study, number: int, settings: Settings) -> bool:
    """Ask Optuna for trial `number` and admit it as a job, committed; False if it could not be (the
    quota: the next pass tries again; a refused spec: the sweep fails, saying why)."""
    study.sampler = _sampler(spec, number)
    trial = study.ask(distributions(spec.search_space))
    system_attrs = study.get_trials(deepcopy=False)[-1].system_attrs
    name = f"{spec.name}-t{number}"
    try:
        job_spec = JobSpec.model_validate({**with_params(sweep.spec["base"], trial.params), "name": name})
        admit(session, session, sweep.owner, job_spec, settings, trial_of=TrialOf(sweep.id, number, {
            "params": trial.params, "system_attrs": system_attrs, "checked_step": -1,
        }))
        log.info("sweep %s: trial %s submitted with %s", sweep.id, number, trial.params)
        return True
    except Refused as exc:
        session.rollback()
        if exc.status == HTTPStatus.TOO_MANY_REQUESTS:
            return False
        where = ".".join(exc.field) if exc.field else "the spec"
        reason = f"trial {number} {trial.params} refused: {where}: {exc.message}"
    except ValidationError as exc:
        session.rollback()
        error = exc.errors()[0]
        reason = f"trial {number} {trial.params} is not a valid job spec: {'.'.join(map(str, error['loc']))}: {error['msg']}"
    sweep, _ = lock_sweep(session, sweep.id)
    finish_sweep(session, sweep, SweepStatus.failed, reason)
    session.commit()
    log.warning("sweep %s failed: %s", sweep.id, reason)
    return False


def _rebuilt_study(session: Session, spec: SweepSpec, jobs: list[Job]) -> optuna.Study:
    """The study as Optuna would hold it had it run these trials, with the new objective points of
    each trial reported to it; a trial the pruner stops is asked to stop (state.request_prune)."""
    optuna = _optuna()
    study = optuna.create_study(direction="minimize" if spec.objective.direction == "min" else "maximize", pruner=_pruner(spec))
    space = distributions(spec.search_space)
    series = objective_series(session, [job.id for job in jobs], spec.objective.metric)
    for job in jobs:
        values = series[job.id]
        checked = job.trial["checked_step"]
        final = optuna.trial.TrialState[name] if (name := FINAL_TRIAL_STATE.get(job.status)) else None
        if final is not None and max(values, default=-1) <= checked:
            study.add_trial(_finished_trial(job, space, values, final))
            continue
        study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState.RUNNING,
            params=job.trial["params"],
            distributions=space,
            intermediate_values={step: value for step, value in values.items() if step <= checked},
            system_attrs=job.trial["system_attrs"],
        ))
        _replay(session, study, spec, job, {step: value for step, value in values.items() if step > checked})
    return study


def _replay(session: Session, study: optuna.Study, spec: SweepSpec, job: Job, new_points: dict[int, float]) -> None:
    """Report a trial's new objective points in step order, asking the pruner after each, and keep
    what that recorded (a pruner's rungs) on the job."""
    if not new_points:
        return
    frozen = study.get_trials(deepcopy=False)[-1]
    trial = _optuna().trial.Trial(study, frozen._trial_id)
    for step, value in sorted(new_points.items()):
        trial.report(value, step)
        if not job.status.is_final and job.prune_reason is None and trial.should_prune():
            reason = f"pruned by the sweep's {spec.pruner.kind} pruner at step {step}: {spec.objective.metric} {value:.4g}"
            state.request_prune(session, job, reason)
            log.info("sweep %s: trial %s (job %s) %s", job.sweep_id, job.trial_number, job.id, reason)
            break
    system_attrs = study.get_trials(deepcopy=False)[-1].system_attrs
    job.trial = {**job.trial, "system_attrs": system_attrs, "checked_step": max(new_points)}


def _finished_trial(job: Job, space: dict, values: dict[int, float], final: TrialState) -> optuna.trial.FrozenTrial:
    trials = _optuna().trial
    last = values[max(values)] if values else None
    if final == trials.TrialState.COMPLETE and (last is None or last != last):  # no objective, or NaN: not a result
        final = trials.TrialState.FAIL
    return trials.create_trial(
        state=final,
        value=last if final == trials.TrialState.COMPLETE else None,
        params=job.trial["params"],
        distributions=space,
        intermediate_values=values,
        system_attrs=job.trial["system_attrs"],
    )


def _sampler(spec: SweepSpec, number: int) -> optuna.samplers.BaseSampler:
    """The sampler for trial `number`, seeded from the sweep's seed and the number: the study is
    rebuilt for every trial, so one seeded sampler kept across trials can't be. A grid keeps the
    sweep's seed, which shuffles its points once for all (its trials hold their point's index)."""
    optuna = _optuna()
    if spec.sampler.kind == "grid":
        return optuna.samplers.GridSampler(grid(spec.search_space), seed=spec.sampler.seed)
    seed = (spec.sampler.seed * 1_000_003 + number) % 2**32
    if spec.sampler.kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    pruner, optuna = spec.pruner, _optuna()
    if pruner.kind == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=pruner.min_steps, reduction_factor=pruner.reduction_factor)
    if pruner.kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=pruner.startup_trials, n_warmup_steps=pruner.min_steps)
    return optuna.pruners.NopPruner()
