"""Data access: every query and commit of the service lives here. Routes check access and call these."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.orm import Session

from api_schemas import AttemptStatus, JobSpec, JobStatus
from service import state
from service.db.models import Attempt, Checkpoint, Job, LogLine, Metric, User, WorkerHost, utcnow

ACTIVE_ATTEMPT = (AttemptStatus.scheduled, AttemptStatus.running)
ACTIVE_JOB = (JobStatus.queued, JobStatus.scheduled, JobStatus.running)


def _insert(session: Session):
    """The dialect's INSERT, which has ON CONFLICT support on both SQLite and PostgreSQL."""
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


# --- users -------------------------------------------------------------------------------------

def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_user(session: Session, name: str, *, is_admin: bool = False, token: str | None = None) -> tuple[User, str]:
    """Create a user and return it with its token; only the token's hash is stored."""
    token = token or secrets.token_urlsafe(32)
    user = User(name=name, token_hash=hash_token(token), is_admin=is_admin)
    session.add(user)
    session.commit()
    return user, token


def user_by_name(session: Session, name: str) -> User | None:
    return session.scalar(select(User).where(User.name == name))


def user_by_token(session: Session, token: str) -> User | None:
    return session.scalar(select(User).where(User.token_hash == hash_token(token)))


# --- jobs --------------------------------------------------------------------------------------

class QuotaExceeded(Exception):
    def __init__(self, limit: int, active: int):
        super().__init__(f"{active} active jobs (queued, scheduled or running); the limit is {limit} per user")
        self.limit, self.active = limit, active


def create_job(
    session: Session, owner: User, spec: JobSpec, idempotency_key: str | None = None, max_active: int | None = None
) -> Job:
    """Queue a job. A retried request with the same Idempotency-Key returns the job it created.

    Raises QuotaExceeded if the owner already has `max_active` active jobs."""
    if idempotency_key:
        existing = session.scalar(select(Job).where(Job.owner_id == owner.id, Job.idempotency_key == idempotency_key))
        if existing:
            return existing
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
        spec=spec.model_dump(mode="json"),
        status=JobStatus.queued,
        priority=spec.priority,
        max_steps=spec.training.max_steps,
        idempotency_key=idempotency_key,
    )
    session.add(job)
    session.commit()
    return job


def active_job_count(session: Session, owner: User) -> int:
    return session.scalar(select(func.count()).select_from(Job).where(Job.owner_id == owner.id, Job.status.in_(ACTIVE_JOB)))


def job_visible_to(session: Session, user: User, job_id: int) -> Job | None:
    """The job if `user` owns it or is an admin; None otherwise, so others can't tell it exists."""
    job = session.get(Job, job_id)
    if job is None or (job.owner_id != user.id and not user.is_admin):
        return None
    return job


def list_jobs(session: Session, user: User, *, status: JobStatus | None, limit: int, before_id: int | None) -> list[Job]:
    """Newest first; `before_id` is the cursor (the last id of the previous page)."""
    query = select(Job).order_by(Job.id.desc()).limit(limit)
    if not user.is_admin:
        query = query.where(Job.owner_id == user.id)
    if status is not None:
        query = query.where(Job.status == status)
    if before_id is not None:
        query = query.where(Job.id < before_id)
    return list(session.scalars(query))


def request_cancel(session: Session, job: Job) -> Job:
    """A queued job is cancelled at once; a placed or running one when its worker notices."""
    if job.status == JobStatus.queued:
        state.move_job(session, job, JobStatus.cancelled, reason="cancelled by user")
    elif not JobStatus(job.status).is_final:
        job.cancel_requested = True
    session.commit()
    # A concurrent transition may have placed the job after we read it: the flag covers that too.
    session.refresh(job)
    return job


# --- metrics and logs --------------------------------------------------------------------------

def record_metrics(session: Session, job_id: int, attempt_id: int, points: list[tuple[int, str, float]]) -> None:
    """Store (step, name, value) points. Idempotent: a re-sent or recomputed point replaces the old one."""
    if not points:
        return
    insert = _insert(session)
    rows = [{"job_id": job_id, "attempt_id": attempt_id, "step": s, "name": n, "value": v} for s, n, v in points]
    statement = insert(Metric).values(rows)
    statement = statement.on_conflict_do_update(
        index_elements=["job_id", "name", "step"],
        set_={"value": statement.excluded.value, "attempt_id": statement.excluded.attempt_id},
    )
    session.execute(statement)
    last_step = max(s for s, _, _ in points)
    session.execute(update(Job).where(Job.id == job_id, Job.step < last_step).values(step=last_step))
    session.commit()


def metric_series(
    session: Session, job_id: int, names: list[str] | None, from_step: int | None, max_points: int
) -> dict[str, tuple[list[int], list[float]]]:
    query = select(Metric.name, Metric.step, Metric.value).where(Metric.job_id == job_id).order_by(Metric.name, Metric.step)
    if names:
        query = query.where(Metric.name.in_(names))
    if from_step is not None:
        query = query.where(Metric.step >= from_step)
    series: dict[str, tuple[list[int], list[float]]] = {}
    for name, step, value in session.execute(query):
        steps, values = series.setdefault(name, ([], []))
        steps.append(step)
        values.append(value)
    return {name: _downsample(steps, values, max_points) for name, (steps, values) in series.items()}


def _downsample(steps: list[int], values: list[float], max_points: int) -> tuple[list[int], list[float]]:
    """Keep each bucket's min, max and last point, so spikes survive (an average would hide them)."""
    if len(steps) <= max_points:
        return steps, values
    buckets = max(1, max_points // 3)
    size = -(-len(steps) // buckets)
    keep: set[int] = set()
    for start in range(0, len(steps), size):
        chunk = range(start, min(start + size, len(steps)))
        keep.update((min(chunk, key=values.__getitem__), max(chunk, key=values.__getitem__), chunk[-1]))
    kept = sorted(keep)
    return [steps[i] for i in kept], [values[i] for i in kept]


def record_logs(session: Session, job_id: int, attempt: ClaimedAttempt, lines: list[tuple[int, str]]) -> None:
    """Store (seq, line) pairs of an attempt's output; re-sent lines are ignored."""
    if not lines:
        return
    insert = _insert(session)
    rows = [
        {"job_id": job_id, "attempt_id": attempt.attempt_id, "attempt_number": attempt.number, "seq": seq, "line": line}
        for seq, line in lines
    ]
    session.execute(insert(LogLine).values(rows).on_conflict_do_nothing(index_elements=["attempt_id", "seq"]))
    session.commit()


def log_tail(session: Session, job_id: int, tail: int) -> list[LogLine]:
    query = select(LogLine).where(LogLine.job_id == job_id).order_by(LogLine.id.desc()).limit(tail)
    return list(reversed(session.scalars(query).all()))


# --- checkpoints -------------------------------------------------------------------------------

def record_checkpoint(
    session: Session, job_id: int, attempt_id: int, step: int, path: str, sha256: str, size_bytes: int, keep_last: int
) -> list[str]:
    """Register a complete checkpoint, then drop the oldest beyond `keep_last`; returns their paths to delete."""
    insert = _insert(session)
    session.execute(
        insert(Checkpoint)
        .values(job_id=job_id, attempt_id=attempt_id, step=step, path=path, sha256=sha256, size_bytes=size_bytes, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["job_id", "step"])
    )
    newest_first = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())).all()
    stale = newest_first[keep_last:]
    if stale:
        session.execute(delete(Checkpoint).where(Checkpoint.id.in_([c.id for c in stale])))
    session.commit()
    return [c.path for c in stale if c.path != path]


def list_checkpoints(session: Session, job_id: int) -> list[Checkpoint]:
    return list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))


def checkpoint_visible_to(session: Session, user: User, checkpoint_id: int) -> Checkpoint | None:
    checkpoint = session.get(Checkpoint, checkpoint_id)
    if checkpoint is None or job_visible_to(session, user, checkpoint.job_id) is None:
        return None
    return checkpoint


def latest_checkpoint(session: Session, job_id: int) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()).limit(1))


# --- worker hosts and attempts (worker side) -------------------------------------------------

def register_host(session: Session, name: str, device: str, slots: int, info: dict) -> None:
    insert = _insert(session)
    now = utcnow()
    statement = insert(WorkerHost).values(name=name, device=device, slots=slots, info=info, registered_at=now, last_heartbeat=now)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=["name"], set_={"device": device, "slots": slots, "info": info, "last_heartbeat": now}
        )
    )
    session.commit()


def deregister_host(session: Session, host_name: str) -> None:
    """A host shutting down takes no more attempts (a later start registers it again)."""
    session.execute(delete(WorkerHost).where(WorkerHost.name == host_name))
    session.commit()


def heartbeat(session: Session, host_name: str) -> None:
    session.execute(update(WorkerHost).where(WorkerHost.name == host_name).values(last_heartbeat=utcnow()))
    session.commit()


@dataclass(frozen=True)
class ClaimedAttempt:
    attempt_id: int
    number: int
    job_id: int
    spec: dict
    slots: int
    lease_owner: str
    resume_checkpoint_path: str | None
    resume_step: int | None


def claim_attempt(session: Session, attempt_id: int, lease_owner: str, lease_seconds: float) -> ClaimedAttempt | None:
    """Take ownership of a scheduled attempt. None if it is not ours to run: already claimed (a
    duplicate delivery of the task), ended, or its job was cancelled meanwhile."""
    attempt = session.get(Attempt, attempt_id)
    if attempt is None or attempt.status != AttemptStatus.scheduled:
        session.rollback()
        return None
    job = attempt.job
    if job.cancel_requested:
        state.end_attempt(session, job, attempt, AttemptStatus.cancelled, reason="cancelled before start")
        session.commit()
        return None
    checkpoint = latest_checkpoint(session, job.id)
    now = utcnow()
    claimed = state.move_attempt(
        session,
        attempt,
        AttemptStatus.running,
        now=now,
        lease_owner=lease_owner,
        lease_expires_at=now + timedelta(seconds=lease_seconds),
        resume_checkpoint_id=checkpoint.id if checkpoint else None,
        resumed_from_step=checkpoint.step if checkpoint else None,
    )
    if not claimed or not state.move_job(session, job, JobStatus.running, now=now):
        session.rollback()
        return None
    job.step = checkpoint.step if checkpoint else 0
    session.commit()
    return ClaimedAttempt(
        attempt_id=attempt.id,
        number=attempt.number,
        job_id=job.id,
        spec=job.spec,
        slots=attempt.slots,
        lease_owner=lease_owner,
        resume_checkpoint_path=checkpoint.path if checkpoint else None,
        resume_step=checkpoint.step if checkpoint else None,
    )


@dataclass(frozen=True)
class Lease:
    held: bool
    cancel_requested: bool


def renew_lease(session: Session, attempt: ClaimedAttempt, lease_seconds: float) -> Lease:
    """Extend our lease. `held` is False once the attempt is no longer ours (reaped as lost)."""
    result = session.execute(
        update(Attempt)
        .where(Attempt.id == attempt.attempt_id, Attempt.lease_owner == attempt.lease_owner, Attempt.status == AttemptStatus.running)
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds))
    )
    cancel = bool(session.scalar(select(Job.cancel_requested).where(Job.id == attempt.job_id)))
    session.commit()
    return Lease(held=result.rowcount == 1, cancel_requested=cancel)


def finish_attempt(session: Session, claimed: ClaimedAttempt, outcome: AttemptStatus, reason: str | None = None) -> bool:
    """Record the end of our attempt; False if we had already lost it."""
    attempt = session.get(Attempt, claimed.attempt_id)
    if attempt is None or attempt.lease_owner != claimed.lease_owner or attempt.status != AttemptStatus.running:
        session.rollback()
        return False
    ended = state.end_attempt(session, attempt.job, attempt, outcome, reason)
    session.commit()
    return ended


# --- scheduler ---------------------------------------------------------------------------------

def lock_scheduler(session: Session) -> None:
    """Serialise scheduler passes across processes (PostgreSQL); SQLite's BEGIN IMMEDIATE already does."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext('trainyard-scheduler'))"))


def online_hosts(session: Session, now: datetime, host_timeout: float) -> list[WorkerHost]:
    cutoff = now - timedelta(seconds=host_timeout)
    return list(session.scalars(select(WorkerHost).where(WorkerHost.last_heartbeat >= cutoff).order_by(WorkerHost.name)))


def busy_slots_by_host(session: Session) -> dict[str, int]:
    query = select(Attempt.host_name, func.sum(Attempt.slots)).where(Attempt.status.in_(ACTIVE_ATTEMPT)).group_by(Attempt.host_name)
    return {host: int(busy) for host, busy in session.execute(query)}


def queued_jobs(session: Session, limit: int) -> list[Job]:
    """Highest priority first, oldest first within a priority; rows locked by another scheduler are skipped."""
    query = (
        select(Job)
        .where(Job.status == JobStatus.queued)
        .order_by(Job.priority.desc(), Job.id)
        .limit(limit)
        .with_for_update(skip_locked=True, of=Job)
    )
    return list(session.scalars(query))


def create_attempt(session: Session, job: Job, host_name: str, slots: int, now: datetime) -> Attempt | None:
    """Place a queued job on a host: a new scheduled attempt, and the job moves to `scheduled`."""
    if not state.move_job(session, job, JobStatus.scheduled, now=now):
        return None
    number = (session.scalar(select(func.max(Attempt.number)).where(Attempt.job_id == job.id)) or 0) + 1
    attempt = Attempt(job_id=job.id, number=number, host_name=host_name, slots=slots, dispatched_at=now)
    session.add(attempt)
    session.flush()
    return attempt


def expired_leases(session: Session, now: datetime) -> list[Attempt]:
    return list(
        session.scalars(select(Attempt).where(Attempt.status == AttemptStatus.running, Attempt.lease_expires_at < now))
    )


def unclaimed_attempts(session: Session) -> list[Attempt]:
    return list(session.scalars(select(Attempt).where(Attempt.status == AttemptStatus.scheduled)))


# --- dashboard ---------------------------------------------------------------------------------

def job_counts(session: Session, user: User) -> dict[str, int]:
    query = select(Job.status, func.count()).group_by(Job.status)
    if not user.is_admin:
        query = query.where(Job.owner_id == user.id)
    counts = {status.value: 0 for status in JobStatus}
    counts.update({JobStatus(status).value: n for status, n in session.execute(query)})
    return counts


def running_jobs(session: Session, user: User) -> list[Job]:
    query = select(Job).where(Job.status == JobStatus.running).order_by(Job.id)
    if not user.is_admin:
        query = query.where(Job.owner_id == user.id)
    return list(session.scalars(query))


def last_metric(session: Session, job_id: int, name: str) -> float | None:
    query = select(Metric.value).where(Metric.job_id == job_id, Metric.name == name).order_by(Metric.step.desc()).limit(1)
    return session.scalar(query)


def all_hosts(session: Session) -> list[WorkerHost]:
    return list(session.scalars(select(WorkerHost).order_by(WorkerHost.name)))
