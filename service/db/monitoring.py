"""Counts for the dashboard and for GET /metrics.

/metrics reads at scrape time: the API may run as several processes, so only the database knows the totals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import case, func, select, text
from sqlalchemy.orm import Session

from api_schemas import AttemptStatus, JobStatus
from service.db.models import TOP_LEVEL, Attempt, Checkpoint, Job, MetricBucket, User
from service.db.state import ACTIVE_ATTEMPT


def active_attempts(session: Session) -> list[Attempt]:
    return list(session.scalars(select(Attempt).where(Attempt.status.in_(ACTIVE_ATTEMPT)).order_by(Attempt.id)))


def job_counts(session: Session, user: User | None) -> dict[str, int]:
    """Jobs per status, every status present: `user`'s, or everyone's for an admin or for None (the service's own view)."""
    query = select(Job.status, func.count()).group_by(Job.status)
    if user is not None and not user.is_admin:
        query = query.where(Job.owner_id == user.id)
    counts = {status.value: 0 for status in JobStatus}
    counts.update({JobStatus(status).value: n for status, n in session.execute(query)})
    return counts


def running_jobs(session: Session, user: User) -> list[Job]:
    query = select(Job).where(Job.status == JobStatus.running).order_by(Job.id)
    if not user.is_admin:
        query = query.where(Job.owner_id == user.id)
    return list(session.scalars(query))


def running_attempt_count(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(Attempt).where(Attempt.status == AttemptStatus.running))


@dataclass(frozen=True)
class DurationHistogram:
    at_or_below: list[int]  # cumulative: how many lasted at most each bound, in the bounds' order
    count: int
    total_seconds: float


def queue_wait_histogram(session: Session, bounds: Sequence[float]) -> DurationHistogram:
    """Seconds from submission to the first attempt starting, over every job that has started."""
    return _duration_histogram(session, Job.created_at, Job.started_at, bounds)


def dispatch_latency_histogram(session: Session, bounds: Sequence[float]) -> DurationHistogram:
    """Seconds from placing an attempt on a host to its worker claiming it, over every attempt that started."""
    return _duration_histogram(session, Attempt.created_at, Attempt.started_at, bounds)


def _duration_histogram(session: Session, start, end, bounds: Sequence[float]) -> DurationHistogram:
    """Counted by the database, which answers one row however many jobs there are: the API no
    longer reads every job's times (the database still scans them)."""
    if session.get_bind().dialect.name == "postgresql":
        seconds = func.extract("epoch", end - start)
    else:  # SQLite keeps timestamps as text; julianday() reads them, in days, to the millisecond
        seconds = (func.julianday(end) - func.julianday(start)) * 86400.0
    row = session.execute(
        select(
            func.count(), func.coalesce(func.sum(seconds), 0),
            *(func.coalesce(func.sum(case((seconds <= bound, 1), else_=0)), 0) for bound in bounds),
        ).where(end.is_not(None))
    ).one()
    return DurationHistogram(at_or_below=[int(n) for n in row[2:]], count=int(row[0]), total_seconds=float(row[1]))


def metric_point_count(session: Session) -> int:
    """Points stored; only grows, since a recomputed point replaces its row and metrics are never
    deleted. Added up from the coarsest bucket summaries, which ingest keeps for every point (one
    row per series and 65,536 steps, in a partial index of their own): a scrape never counts points."""
    return session.scalar(select(func.coalesce(func.sum(MetricBucket.count), 0)).where(text(TOP_LEVEL)))


def checkpoint_bytes(session: Session) -> int:
    """Bytes of model.safetensors over the checkpoints kept (retention deletes older ones)."""
    return session.scalar(select(func.coalesce(func.sum(Checkpoint.size_bytes), 0)))
