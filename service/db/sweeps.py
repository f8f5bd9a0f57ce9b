"""Sweeps as their owners see them (submit, list, cancel) and as their controller reads them: each
sweep's trial jobs with their objective series."""

from __future__ import annotations

import math

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from api_schemas import SweepSpec, SweepStatus
from service.db.jobs import ask_to_cancel
from service.db.models import Job, Metric, Sweep, User, utcnow


def create_sweep(session: Session, owner: User, spec: SweepSpec) -> Sweep:
    sweep = Sweep(owner_id=owner.id, name=spec.name, spec=spec.model_dump(mode="json"), status=SweepStatus.running)
    session.add(sweep)
    session.commit()
    return sweep


def sweep_visible_to(session: Session, user: User, sweep_id: int) -> Sweep | None:
    """The sweep if `user` owns it or is an admin; None otherwise, so others can't tell it exists."""
    sweep = session.get(Sweep, sweep_id)
    if sweep is None or (sweep.owner_id != user.id and not user.is_admin):
        return None
    return sweep


def sweeps_visible_to(session: Session, user: User, *, limit: int, before_id: int | None) -> list[Sweep]:
    """Newest first; `before_id` is the cursor (the last id of the previous page)."""
    query = select(Sweep).order_by(Sweep.id.desc()).limit(limit)
    if not user.is_admin:
        query = query.where(Sweep.owner_id == user.id)
    if before_id is not None:
        query = query.where(Sweep.id < before_id)
    return list(session.scalars(query))


def trial_jobs(session: Session, sweep_ids: list[int]) -> dict[int, list[Job]]:
    """{sweep id: its trials' jobs in trial order}."""
    trials: dict[int, list[Job]] = {sweep_id: [] for sweep_id in sweep_ids}
    query = select(Job).where(Job.sweep_id.in_(sweep_ids)).order_by(Job.sweep_id, Job.trial_number)
    for job in session.scalars(query):
        trials[job.sweep_id].append(job)
    return trials


def running_sweep_ids(session: Session) -> list[int]:
    return list(session.scalars(select(Sweep.id).where(Sweep.status == SweepStatus.running).order_by(Sweep.id)))


def lock_sweep(session: Session, sweep_id: int) -> tuple[Sweep, int]:
    """The sweep, locked until this transaction ends so that one controller at a time adds its
    trials (PostgreSQL; SQLite's BEGIN IMMEDIATE already serialises writers), and how many it has."""
    sweep = session.scalar(select(Sweep).where(Sweep.id == sweep_id).with_for_update(of=Sweep).execution_options(populate_existing=True))
    return sweep, session.scalar(select(func.count()).select_from(Job).where(Job.sweep_id == sweep_id))


def objective_series(session: Session, job_ids: list[int], metric: str) -> dict[int, dict[int, float]]:
    """{job id: {step: value}} of one metric; a NaN or infinite value (stored as NULL) is NaN."""
    series: dict[int, dict[int, float]] = {job_id: {} for job_id in job_ids}
    query = select(Metric.job_id, Metric.step, Metric.value).where(Metric.job_id.in_(job_ids), Metric.name == metric).order_by(Metric.step)
    for job_id, step, value in session.execute(query):
        series[job_id][step] = math.nan if value is None else value
    return series


def finish_sweep(session: Session, sweep: Sweep, status: SweepStatus, reason: str | None = None) -> bool:
    """Move a running sweep to a final status; False if it had ended already (cancelled meanwhile)."""
    moved = session.execute(
        update(Sweep)
        .where(Sweep.id == sweep.id, Sweep.status == SweepStatus.running)
        .values(status=status, failure_reason=reason, finished_at=utcnow())
    ).rowcount == 1
    session.refresh(sweep)
    return moved


def cancel_sweep(session: Session, sweep: Sweep) -> Sweep:
    """The sweep ends `cancelled` and so do its unfinished trials (a running one when its worker notices)."""
    if finish_sweep(session, sweep, SweepStatus.cancelled, "cancelled by user"):
        for job in trial_jobs(session, [sweep.id])[sweep.id]:
            ask_to_cancel(session, job)
    session.commit()
    return sweep
