"""Data access: every query and commit of the service lives here. Routes check access and call these."""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, or_, select, text, update
from sqlalchemy.orm import Session

from api_schemas import AttemptStatus, JobEventType, JobSpec, JobStatus
from service import state
from service.db.models import Attempt, Checkpoint, Job, JobEvent, LogLine, Metric, User, WorkerHost, utcnow

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
    session.flush()
    state.append_events(session, job.id, [state.status_event(JobStatus.queued)])
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

_UPSERT_METRIC_ARRAYS = text("""
    INSERT INTO metrics (job_id, attempt_id, step, name, value)
    SELECT CAST(:job_id AS bigint), CAST(:attempt_id AS bigint), step, name, value
    FROM unnest(CAST(:steps AS integer[]), CAST(:names AS varchar[]), CAST(:values AS double precision[])) AS point(step, name, value)
    ON CONFLICT (job_id, name, step) DO UPDATE SET value = excluded.value, attempt_id = excluded.attempt_id
""")


def record_metrics(session: Session, job_id: int, attempt_id: int, points: list[tuple[int, str, float]]) -> None:
    """Store (step, name, value) points. Idempotent: a re-sent or recomputed point replaces the old one.

    A NaN or infinite value (a diverged run) is stored as NULL: SQLite can't hold NaN, JSON can't
    carry it, and the run must still report every other point rather than fail on that one."""
    if not points:
        return
    # Keyed by (step, name): a point sent twice in one batch counts once, the later value winning,
    # as it would across batches (PostgreSQL refuses to upsert one row twice in one statement).
    latest = {(step, name): value if math.isfinite(value) else None for step, name, value in points}
    points = [(step, name, value) for (step, name), value in latest.items()]
    if session.get_bind().dialect.name == "postgresql":
        # The whole batch in one statement of three array parameters, unnested by the server: a
        # row per point would cost a statement (or 5 bind parameters) per point.
        session.execute(_UPSERT_METRIC_ARRAYS, {
            "job_id": job_id, "attempt_id": attempt_id,
            "steps": [s for s, _, _ in points], "names": [n for _, n, _ in points], "values": [v for _, _, v in points],
        })
    else:
        # SQLite runs in-process: executemany of one cached statement is as fast as it gets there.
        statement = _insert(session)(Metric)
        statement = statement.on_conflict_do_update(
            index_elements=["job_id", "name", "step"],
            set_={"value": statement.excluded.value, "attempt_id": statement.excluded.attempt_id},
        )
        session.execute(statement, [{"job_id": job_id, "attempt_id": attempt_id, "step": s, "name": n, "value": v} for s, n, v in points])
    last_step = max(s for s, _, _ in points)
    session.execute(update(Job).where(Job.id == job_id, Job.step < last_step).values(step=last_step))
    by_step: dict[int, dict[str, float | None]] = {}
    for step, name, value in points:
        by_step.setdefault(step, {})[name] = value
    state.append_events(session, job_id, [(JobEventType.metrics, {"step": s, "values": v}) for s, v in sorted(by_step.items())])
    session.commit()


def metric_series(
    session: Session, job_id: int, names: list[str] | None, from_step: int | None, max_points: int
) -> dict[str, tuple[list[int], list[float | None]]]:
    query = select(Metric.name, Metric.step, Metric.value).where(Metric.job_id == job_id).order_by(Metric.name, Metric.step)
    if names:
        query = query.where(Metric.name.in_(names))
    if from_step is not None:
        query = query.where(Metric.step >= from_step)
    series: dict[str, tuple[list[int], list[float | None]]] = {}
    for name, step, value in session.execute(query):
        steps, values = series.setdefault(name, ([], []))
        steps.append(step)
        values.append(value)
    return {name: _downsample(steps, values, max_points) for name, (steps, values) in series.items()}


def _downsample(steps: list[int], values: list[float | None], max_points: int) -> tuple[list[int], list[float | None]]:
    """Keep each bucket's min, max and last point, so spikes survive (an average would hide them)."""
    if len(steps) <= max_points:
        return steps, values
    buckets = max(1, max_points // 3)
    size = -(-len(steps) // buckets)
    keep: set[int] = set()
    for start in range(0, len(steps), size):
        chunk = range(start, min(start + size, len(steps)))
        finite = [i for i in chunk if values[i] is not None]
        if finite:
            keep.update((min(finite, key=values.__getitem__), max(finite, key=values.__getitem__)))
        # The first NaN of a bucket is the worst spike of all: never downsampled away.
        keep.update([next((i for i in chunk if values[i] is None), chunk[-1]), chunk[-1]])
    kept = sorted(keep)
    return [steps[i] for i in kept], [values[i] for i in kept]


def record_logs(session: Session, job_id: int, attempt: ClaimedAttempt, lines: list[tuple[int, int | None, str]]) -> None:
    """Store (seq, rank, line) triples of an attempt's output; re-sent lines are ignored."""
    if not lines:
        return
    insert = _insert(session)
    rows = [
        {"job_id": job_id, "attempt_id": attempt.attempt_id, "attempt_number": attempt.number, "seq": seq, "rank": rank, "line": line}
        for seq, rank, line in lines
    ]
    session.execute(insert(LogLine).values(rows).on_conflict_do_nothing(index_elements=["attempt_id", "seq"]))
    session.commit()


def log_tail(session: Session, job_id: int, tail: int, rank: int | None = None) -> list[LogLine]:
    query = select(LogLine).where(LogLine.job_id == job_id).order_by(LogLine.id.desc()).limit(tail)
    if rank is not None:
        query = query.where(LogLine.rank == rank)
    return list(reversed(session.scalars(query).all()))


def log_lines_after(session: Session, job_id: int, after_id: int, limit: int, rank: int | None = None) -> list[LogLine]:
    """At most `limit` lines stored after line `after_id`, oldest first: one bounded page."""
    query = select(LogLine).where(LogLine.job_id == job_id, LogLine.id > after_id).order_by(LogLine.id).limit(limit)
    if rank is not None:
        query = query.where(LogLine.rank == rank)
    return list(session.scalars(query))


# --- job events --------------------------------------------------------------------------------

def job_events_after(session: Session, job_id: int, after_seq: int, limit: int) -> list[JobEvent]:
    """The job's events numbered after `after_seq`, oldest first."""
    query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > after_seq).order_by(JobEvent.seq).limit(limit)
    return list(session.scalars(query))


def job_status(session: Session, job_id: int) -> JobStatus:
    return JobStatus(session.scalar(select(Job.status).where(Job.id == job_id)))


# --- checkpoints -------------------------------------------------------------------------------

def record_checkpoint(
    session: Session, job_id: int, attempt_id: int, step: int, path: str, sha256: str, size_bytes: int, keep_last: int
) -> list[str]:
    """Register a complete checkpoint, then drop the oldest beyond `keep_last`; returns their paths to delete."""
    insert = _insert(session)
    checkpoint_id = session.scalar(
        insert(Checkpoint)
        .values(job_id=job_id, attempt_id=attempt_id, step=step, path=path, sha256=sha256, size_bytes=size_bytes, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["job_id", "step"])
        .returning(Checkpoint.id)
    )
    if checkpoint_id is not None:  # None: a re-sent checkpoint, already recorded
        data = {"checkpoint_id": checkpoint_id, "step": step, "sha256": sha256, "size_bytes": size_bytes}
        state.append_events(session, job_id, [(JobEventType.checkpoint, data)])
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

def register_host(session: Session, name: str, device: str, slots: int, info: dict, address: str = "127.0.0.1") -> None:
    insert = _insert(session)
    now = utcnow()
    values = {"device": device, "slots": slots, "info": info, "address": address, "last_heartbeat": now}
    statement = insert(WorkerHost).values(name=name, registered_at=now, **values)
    session.execute(statement.on_conflict_do_update(index_elements=["name"], set_=values))
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
    node_rank: int
    job_id: int
    spec: dict
    slots: int
    device_ids: list[int] | None
    lease_owner: str
    resume_checkpoint_path: str | None
    resume_step: int | None


def claim_attempt(
    session: Session, attempt_id: int, lease_owner: str, lease_seconds: float, rendezvous: str | None = None
) -> ClaimedAttempt | None:
    """Take ownership of a scheduled attempt. None if it is not ours to run: already claimed (a
    duplicate delivery of the task), ended, or its job was cancelled meanwhile. `rendezvous` is the
    host:port this worker's node 0 of a gang would listen on; the other nodes read it from here."""
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
        rendezvous=rendezvous,
    )
    # The first node of a gang to start moves the job to running; the others find it there.
    job_running = job.status == JobStatus.running or state.move_job(session, job, JobStatus.running, now=now)
    if not claimed or not job_running:
        session.rollback()
        return None
    job.step = checkpoint.step if checkpoint else 0
    session.commit()
    return ClaimedAttempt(
        attempt_id=attempt.id,
        number=attempt.number,
        node_rank=attempt.node_rank,
        job_id=job.id,
        spec=job.spec,
        slots=attempt.slots,
        device_ids=attempt.device_ids,
        lease_owner=lease_owner,
        resume_checkpoint_path=checkpoint.path if checkpoint else None,
        resume_step=checkpoint.step if checkpoint else None,
    )


@dataclass(frozen=True)
class Lease:
    held: bool
    cancel_requested: bool
    preempt_requested: bool = False


def renew_lease(session: Session, attempt: ClaimedAttempt, lease_seconds: float) -> Lease:
    """Extend our lease. `held` is False once the attempt is no longer ours (reaped as lost)."""
    result = session.execute(
        update(Attempt)
        .where(Attempt.id == attempt.attempt_id, Attempt.lease_owner == attempt.lease_owner, Attempt.status == AttemptStatus.running)
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds))
    )
    cancel = bool(session.scalar(select(Job.cancel_requested).where(Job.id == attempt.job_id)))
    # Any node of a gang asked to stop stops the whole gang (its training processes vote together).
    preempt = bool(session.scalar(select(func.count()).where(
        Attempt.job_id == attempt.job_id, Attempt.number == attempt.number, Attempt.preempt_requested.is_(True)
    )))
    session.commit()
    return Lease(held=result.rowcount == 1, cancel_requested=cancel, preempt_requested=preempt)


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


def active_attempts(session: Session) -> list[Attempt]:
    return list(session.scalars(select(Attempt).where(Attempt.status.in_(ACTIVE_ATTEMPT)).order_by(Attempt.id)))


def busy_slots_by_host(session: Session) -> dict[str, int]:
    query = select(Attempt.host_name, func.sum(Attempt.slots)).where(Attempt.status.in_(ACTIVE_ATTEMPT)).group_by(Attempt.host_name)
    return {host: int(busy) for host, busy in session.execute(query)}


def busy_gpus_by_host(session: Session) -> dict[str, set[int]]:
    query = select(Attempt.host_name, Attempt.device_ids).where(Attempt.status.in_(ACTIVE_ATTEMPT), Attempt.device_ids.is_not(None))
    busy: dict[str, set[int]] = {}
    for host, device_ids in session.execute(query):
        busy.setdefault(host, set()).update(device_ids or [])
    return busy


def preemptible_attempts(session: Session) -> list[Attempt]:
    """Running attempts of preemptible jobs, including those already asked to stop."""
    query = select(Attempt).where(Attempt.status == AttemptStatus.running)
    return [attempt for attempt in session.scalars(query) if attempt.job.spec.get("preemptible")]


def request_preemption(attempt: Attempt) -> None:
    """Its worker sees this at the next lease renewal and stops it at a checkpoint."""
    attempt.preempt_requested = True


def set_waiting_reason(job: Job, reason: str) -> None:
    if job.waiting_reason != reason:  # most passes change nothing: write only what did
        job.waiting_reason = reason


def queued_jobs(session: Session, limit: int) -> list[Job]:
    """Highest priority first, oldest first within a priority; rows locked by another scheduler are skipped."""
    query = (
        select(Job)
        .where(Job.status == JobStatus.queued)
        .order_by(Job.priority.desc(), Job.id)
        .limit(limit)
        .with_for_update(skip_locked=True, of=Job)
        # Reload jobs this session already holds, attempts included: place_jobs numbers from them.
        .execution_options(populate_existing=True)
    )
    return list(session.scalars(query))


def create_attempts(
    session: Session, job: Job, placements: list[tuple[str, list[int] | None]], slots: int, now: datetime
) -> list[Attempt]:
    """place_jobs for one job: its attempts, [] if the job was taken meanwhile."""
    return place_jobs(session, [(job, placements, slots)], now)


def place_jobs(
    session: Session, placements: list[tuple[Job, list[tuple[str, list[int] | None]], int]], now: datetime
) -> list[Attempt]:
    """Place queued jobs, each on its hosts at once (one attempt per node, node 0 first, each with
    the GPU indices reserved for it there, None or [] on CPU): each job moves to `scheduled` and
    gets new scheduled attempts sharing one number, with `slots` slots each. A job another process
    took meanwhile gets none. Returns the attempts created.

    Each job's attempts must be current, so read the jobs in this transaction (queued_jobs does):
    their row locks then keep anyone else from adding attempts until commit."""
    moved = {job.id for job in state.schedule_jobs(session, [job for job, _, _ in placements], now=now)}
    attempts = []
    for job, hosts, slots in placements:
        if job.id not in moved:
            continue
        number = max((attempt.number for attempt in job.attempts), default=0) + 1
        attempts += [
            Attempt(job=job, number=number, node_rank=rank, host_name=host, slots=slots, device_ids=gpus or None, dispatched_at=now)
            for rank, (host, gpus) in enumerate(hosts)
        ]
    session.add_all(attempts)
    session.flush()  # one INSERT for all of them, which gives them their ids
    return attempts


def gang_rendezvous(session: Session, claimed: ClaimedAttempt) -> str | None:
    """host:port of node 0 of our try, once it has claimed its attempt; None until then."""
    query = select(Attempt.rendezvous).where(
        Attempt.job_id == claimed.job_id, Attempt.number == claimed.number, Attempt.node_rank == 0
    )
    rendezvous = session.scalar(query)
    session.commit()
    return rendezvous


def expired_leases(session: Session, now: datetime) -> list[Attempt]:
    return list(
        session.scalars(select(Attempt).where(Attempt.status == AttemptStatus.running, Attempt.lease_expires_at < now))
    )


def unclaimed_attempts(session: Session, online: set[str], resend_before: datetime) -> list[Attempt]:
    """Attempts placed but not claimed yet whose host went offline or whose dispatch is older than
    `resend_before`: the ones the scheduler acts on. The rest are left in the database, so a pass
    costs the same however many fresh dispatches are in flight."""
    query = select(Attempt).where(
        Attempt.status == AttemptStatus.scheduled,
        or_(Attempt.host_name.not_in(online), Attempt.dispatched_at < resend_before),
    )
    return list(session.scalars(query))


# --- dashboard ---------------------------------------------------------------------------------

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


def latest_metrics(session: Session, job_ids: list[int], names: list[str]) -> dict[int, dict[str, float]]:
    """{job_id: {name: value at that series' last step}}, in one query for a whole page of jobs."""
    if not job_ids:
        return {}
    last = (
        select(Metric.job_id, Metric.name, func.max(Metric.step).label("step"))
        .where(Metric.job_id.in_(job_ids), Metric.name.in_(names))
        .group_by(Metric.job_id, Metric.name)
        .subquery()
    )
    query = select(Metric.job_id, Metric.name, Metric.value).join(
        last, (Metric.job_id == last.c.job_id) & (Metric.name == last.c.name) & (Metric.step == last.c.step)
    )
    latest: dict[int, dict[str, float]] = {}
    for job_id, name, value in session.execute(query):
        latest.setdefault(job_id, {})[name] = value
    return latest


def all_hosts(session: Session) -> list[WorkerHost]:
    return list(session.scalars(select(WorkerHost).order_by(WorkerHost.name)))


# --- monitoring (GET /metrics) -----------------------------------------------------------------
# Read at scrape time: the API may run as several processes, so only the database knows the totals.

def running_attempt_count(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(Attempt).where(Attempt.status == AttemptStatus.running))


def queue_waits(session: Session) -> list[float]:
    """Seconds from submission to the first attempt starting, for every job that has started."""
    rows = session.execute(select(Job.created_at, Job.started_at).where(Job.started_at.is_not(None)))
    return [(started - created).total_seconds() for created, started in rows]


def dispatch_latencies(session: Session) -> list[float]:
    """Seconds from placing an attempt on a host to its worker claiming it, for every attempt that started."""
    rows = session.execute(select(Attempt.created_at, Attempt.started_at).where(Attempt.started_at.is_not(None)))
    return [(started - created).total_seconds() for created, started in rows]


def metric_point_count(session: Session) -> int:
    """Points stored; only grows, since a recomputed point replaces its row and metrics are never deleted."""
    return session.scalar(select(func.count()).select_from(Metric))


def checkpoint_bytes(session: Session) -> int:
    """Bytes of model.safetensors over the checkpoints kept (retention deletes older ones)."""
    return session.scalar(select(func.coalesce(func.sum(Checkpoint.size_bytes), 0)))
