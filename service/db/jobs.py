"""Jobs as their owners see them: submit (with the active-job quota), list, cancel, and the event log."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api_schemas import JobEventType, JobSpec, JobStatus
from service.db import state
from service.db.doorbell import ring
from service.db.models import Job, JobEvent, User


class QuotaExceeded(Exception):
    def __init__(self, limit: int, active: int):
        super().__init__(f"{active} active jobs (queued, scheduled or running); the limit is {limit} per user")
        self.limit, self.active = limit, active


class KeyReused(Exception):
    """An Idempotency-Key sent again with another spec: a retry sends the same one."""

    def __init__(self, job_id: int):
        super().__init__(f"this Idempotency-Key was used for job {job_id}, with another spec: a retry sends the same spec, a new job a new key")
        self.job_id = job_id


@dataclass(frozen=True)
class TrialOf:
    """A job that is a sweep's trial: its number there, and the trial as Optuna knows it (see Job.trial)."""

    sweep_id: int
    number: int
    trial: dict


def create_job(
    session: Session,
    owner: User,
    spec: JobSpec,
    idempotency_key: str | None = None,
    max_active: int | None = None,
    trial_of: TrialOf | None = None,
    team_id: int | None = None,
) -> Job:
    """Queue a job (under the team `team_id`, if any). A retried request with the same Idempotency-Key returns the job it created.
    A sweep's trial is recorded with it, in the same transaction (unique per sweep and number).

    Raises QuotaExceeded if the owner already has `max_active` active jobs, KeyReused if the key
    made a job of another spec."""
    stored_spec = spec.model_dump(mode="json")
    by_key = select(Job).where(Job.owner_id == owner.id, Job.idempotency_key == idempotency_key)
    if idempotency_key and (existing := session.scalar(by_key)):
        session.commit()  # hand the connection back: the caller reads next, and 30 retries at once each holding one took the pool
        return _same_spec(existing, stored_spec)
    if max_active is not None:
        # Lock the owner's row so two concurrent submits can't both see room for one more job
        # (PostgreSQL; SQLite's BEGIN IMMEDIATE already serialises writers).
        session.execute(select(User.id).where(User.id == owner.id).with_for_update())
        active = active_job_count(session, owner)
        if active >= max_active:
            session.rollback()
            raise QuotaExceeded(max_active, active)
    job = Job(
        owner_id=owner.id,
        name=spec.name,
        spec=stored_spec,
        status=JobStatus.queued,
        priority=spec.priority,
        max_steps=spec.training.max_steps or 0,  # 0: a script that didn't say
        idempotency_key=idempotency_key,
        team_id=team_id,
    )
    if trial_of is not None:
        job.sweep_id, job.trial_number, job.trial = trial_of.sweep_id, trial_of.number, trial_of.trial
    session.add(job)
    try:
        session.flush()
    except IntegrityError:
        if not idempotency_key:
            raise
        # A concurrent retry with the same key inserted first (the unique constraint decided): its job.
        session.rollback()
        existing = session.scalar(by_key)
        session.commit()
        return _same_spec(existing, stored_spec)
    state.append_events(session, job.id, [state.status_event(JobStatus.queued)])
    ring(session)
    session.commit()
    return job


def _same_spec(existing: Job, stored_spec: dict) -> Job:
    """The job an Idempotency-Key made, when sent again with the same spec; else KeyReused: a client
    that reused a key for another job would be handed the first, and think it submitted this one."""
    if existing.spec != stored_spec:
        raise KeyReused(existing.id)
    return existing


def rollback_events(session: Session, job_id: int) -> list[dict]:
    """The data of the job's `rollback` events, oldest first."""
    query = select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == JobEventType.rollback).order_by(JobEvent.seq)
    return list(session.scalars(query))


def active_job_count(session: Session, owner: User) -> int:
    return session.scalar(select(func.count()).select_from(Job).where(Job.owner_id == owner.id, Job.status.in_(state.ACTIVE_JOB)))


def job_visible_to(session: Session, user: User, job_id: int) -> Job | None:
    """The job if `user` owns it or is an admin; None otherwise, so others can't tell it exists."""
    job = session.get(Job, job_id)
    if job is None or (job.owner_id != user.id and not user.is_admin):
        return None
    return job


def jobs_visible_to(
    session: Session, user: User, *, status: JobStatus | None, limit: int, before_id: int | None, search: str | None = None
) -> list[Job]:
    """Newest first; `before_id` is the cursor (the last id of the previous page); `search`: text
    that the job's name or its owner's contains, in any case."""
    query = select(Job).order_by(Job.id.desc()).limit(limit)
    if not user.is_admin:
        query = query.where(Job.owner_id == user.id)
    if status is not None:
        query = query.where(Job.status == status)
    if search:
        pattern = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"  # the text itself, no wildcards
        owners = select(User.id).where(User.name.ilike(pattern, escape="\\"))
        query = query.where(or_(Job.name.ilike(pattern, escape="\\"), Job.owner_id.in_(owners)))
    if before_id is not None:
        query = query.where(Job.id < before_id)
    return list(session.scalars(query))


def request_cancel(session: Session, job: Job) -> Job:
    """A queued job is cancelled at once; a placed or running one when its worker notices."""
    ask_to_cancel(session, job)
    session.commit()
    # A concurrent transition may have placed the job after we read it: the flag covers that too.
    session.refresh(job)
    return job


def ask_to_cancel(session: Session, job: Job) -> None:
    """request_cancel without the commit, for a caller that cancels more in the same transaction."""
    if job.status == JobStatus.queued:
        state.move_job(session, job, JobStatus.cancelled, reason="cancelled by user")
    elif not JobStatus(job.status).is_final:
        job.cancel_requested = True


def job_events_after(session: Session, job_id: int, after_seq: int, limit: int) -> list[JobEvent]:
    """The job's events numbered after `after_seq`, oldest first."""
    query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > after_seq).order_by(JobEvent.seq).limit(limit)
    return list(session.scalars(query))


def last_event_seq(session: Session, job_id: int) -> int:
    """The seq of the job's latest event; 0 before any."""
    return session.scalar(select(func.coalesce(func.max(JobEvent.seq), 0)).where(JobEvent.job_id == job_id))


def job_status(session: Session, job_id: int) -> JobStatus:
    return JobStatus(session.scalar(select(Job.status).where(Job.id == job_id)))
