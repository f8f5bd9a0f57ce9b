"""What the scheduler reads and writes in a pass: the queue, the hosts' load, placements, expired leases."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import bindparam, func, or_, select, text
from sqlalchemy.orm import Session, contains_eager, lazyload

from api_schemas import AttemptStatus, JobStatus
from service.db import state
from service.db.dialect import is_postgresql, list_param, none_of
from service.db.models import Attempt, Job, WorkerHost


def lock_scheduler(session: Session) -> None:
    """Serialise scheduler passes across processes (PostgreSQL); SQLite's BEGIN IMMEDIATE already does."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext('trainyard-scheduler'))"))


_ONLINE_HOSTS = select(WorkerHost).where(WorkerHost.last_heartbeat >= bindparam("cutoff")).order_by(WorkerHost.name)
# Summed in the database: a row per active attempt cost a pass over a large backlog more with
# every pass that placed part of it.
_BUSY_SLOTS = select(Attempt.host_name, func.sum(Attempt.slots)).where(Attempt.status.in_(state.ACTIVE_ATTEMPT)).group_by(Attempt.host_name)
_BUSY_GPUS = (
    select(Attempt.host_name, Attempt.device_ids)
    .join(WorkerHost, WorkerHost.name == Attempt.host_name)
    .where(Attempt.status.in_(state.ACTIVE_ATTEMPT), WorkerHost.device == "cuda")
)


def online_hosts_with_load(
    session: Session, now: datetime, host_timeout: float
) -> tuple[list[WorkerHost], dict[str, int], dict[str, set[int]]]:
    """The online hosts, the process slots their active attempts hold, and on GPU hosts which GPU
    indices: what a scheduler pass places by."""
    hosts = list(session.scalars(_ONLINE_HOSTS, {"cutoff": now - timedelta(seconds=host_timeout)}))
    slots = {host: int(used) for host, used in session.execute(_BUSY_SLOTS)}
    gpus: dict[str, set[int]] = {}
    for host, device_ids in session.execute(_BUSY_GPUS):
        gpus.setdefault(host, set()).update(device_ids or [])
    return hosts, slots, gpus


def preemptible_attempts(session: Session) -> list[Attempt]:
    """Running attempts of preemptible jobs, including those already asked to stop."""
    # With their jobs in the same read: one query, not one more per running attempt.
    query = select(Attempt).join(Attempt.job).options(contains_eager(Attempt.job)).where(Attempt.status == AttemptStatus.running)
    return [attempt for attempt in session.scalars(query) if attempt.job.spec.get("preemptible")]


def shrunk_attempts(session: Session) -> list[Attempt]:
    """Running attempts on fewer processes than their job's own (elastic jobs placed smaller), with their jobs."""
    query = (
        select(Attempt).join(Attempt.job).options(contains_eager(Attempt.job))
        .where(Attempt.status == AttemptStatus.running, Attempt.slots < Job.spec["resources"]["processes_per_node"].as_integer())
    )
    return list(session.scalars(query))


def request_preemption(attempt: Attempt, reason: str | None = None) -> None:
    """Its worker sees this (and `reason`) at the next lease renewal and stops it at a checkpoint."""
    attempt.preempt_requested = True
    attempt.preempt_reason = reason


def set_waiting_reason(job: Job, reason: str) -> None:
    if job.waiting_reason != reason:  # most passes change nothing: write only what did
        job.waiting_reason = reason


def queued_jobs(session: Session, limit: int) -> list[Job]:
    """Highest priority first, oldest first within a priority; rows locked by another scheduler are skipped."""
    return list(session.scalars(_QUEUED_JOBS, {"limit": limit}))


_QUEUED_JOBS = (
    select(Job)
    .where(Job.status == JobStatus.queued)
    .order_by(Job.priority.desc(), Job.id)
    .limit(bindparam("limit"))
    .with_for_update(skip_locked=True, of=Job)
    # Neither their attempts nor their owners: a pass needs neither, and each is a join or a
    # query more on the path of every job's start.
    .options(lazyload(Job.attempts), lazyload(Job.owner))
    .execution_options(populate_existing=True)  # this pass's own changes (a reaped job re-queued) read back
)


@dataclass(frozen=True)
class PlacedAttempt:
    id: int
    job_id: int
    number: int
    host_name: str


def place_jobs(
    session: Session, placements: list[tuple[Job, list[tuple[str, list[int] | None]], int]], now: datetime, pool: str | None = None
) -> list[PlacedAttempt]:
    """Place queued jobs, each on its hosts at once (one attempt per node, node 0 first, each with
    the GPU indices reserved for it there, None or [] on CPU): each job moves to `scheduled` and
    gets new scheduled attempts sharing one number, with `slots` slots each. A job another process
    took meanwhile gets none. Returns the attempts created.

    Read the jobs in this transaction (queued_jobs does): their row locks then keep anyone else
    from placing them too until commit. `pool`: the jobs are handed to that cluster pool, which
    places their nodes itself; their "host" is then the name their try's token acts as (pool_host)."""
    next_number = state.schedule_jobs(session, [job for job, _, _ in placements], now=now)
    rows = [
        {"job_id": job.id, "number": next_number[job.id], "node_rank": rank, "host_name": host, "slots": slots,
         "device_ids": gpus or None, "status": AttemptStatus.scheduled, "dispatched_at": now, "pool": pool}
        for job, hosts, slots in placements if job.id in next_number
        for rank, (host, gpus) in enumerate(hosts)
    ]
    if not rows:
        return []
    # One INSERT for all of them, which gives them their ids; a Core insert, as the ORM's unit of
    # work took as much CPU as moving the jobs to scheduled. On PostgreSQL the rows travel as one
    # JSON array: psycopg converted SQLAlchemy's multi-row VALUES (a placeholder per column per
    # row) afresh each time, a quarter of a pass placing 1,000 jobs.
    if is_postgresql(session):
        fields = ("job_id", "number", "node_rank", "host_name", "slots", "device_ids", "pool")
        payload = json.dumps([{name: row[name] for name in fields} for row in rows])
        returned = session.execute(_INSERT_ATTEMPTS_JSON, {"rows": payload, "now": now})
        id_of = {(job_id, rank): id for id, job_id, rank in returned}  # RETURNING keeps no order
        ids = [id_of[row["job_id"], row["node_rank"]] for row in rows]
    else:
        attempts = Attempt.__table__
        ids = session.scalars(attempts.insert().returning(attempts.c.id, sort_by_parameter_order=True), rows).all()
    return [PlacedAttempt(id, row["job_id"], row["number"], row["host_name"]) for id, row in zip(ids, rows)]


def pool_host(pool: str, job_id: int) -> str:
    """The name a pool job's attempts are placed "on": what the token its try's agents get acts as
    (a ':' no registered host's name has, so it is never one of theirs)."""
    return f"{pool}:job{job_id}"


def pool_of(host_name: str) -> str | None:
    """The pool whose attempt's host name this is (pool_host); None for a registered host's."""
    pool, colon, _ = host_name.partition(":")
    return pool if colon else None


_INSERT_ATTEMPTS_JSON = text("""
    INSERT INTO attempts (job_id, number, node_rank, host_name, slots, device_ids, pool, status, preempt_requested, dispatched_at, created_at)
    SELECT r.job_id, r.number, r.node_rank, r.host_name, r.slots, r.device_ids, r.pool, 'scheduled', false, :now, :now
    FROM json_to_recordset(CAST(:rows AS json)) AS r(job_id bigint, number int, node_rank int, host_name text, slots int, device_ids json, pool text)
    RETURNING id, job_id, node_rank
""")


def expired_leases(session: Session, now: datetime) -> list[Attempt]:
    return list(
        session.scalars(select(Attempt).where(Attempt.status == AttemptStatus.running, Attempt.lease_expires_at < now))
    )


def unclaimed_attempts(session: Session, online: set[str], resend_before: datetime) -> list[Attempt]:
    """Attempts placed but not claimed yet whose host went offline or whose dispatch is older than
    `resend_before`: the ones the scheduler acts on. The rest are left in the database, so a pass
    costs the same however many fresh dispatches are in flight."""
    postgresql = is_postgresql(session)
    query = _UNCLAIMED[postgresql]
    return list(session.scalars(query, {"online": list_param(sorted(online), postgresql), "resend_before": resend_before}))


_UNCLAIMED = {  # by whether the database is PostgreSQL
    postgresql: select(Attempt).where(
        Attempt.status == AttemptStatus.scheduled,
        Attempt.pool.is_(None),  # a pool's attempts wait in its cluster's queue: service/backends/ looks after them
        or_(none_of(Attempt.host_name, "online", postgresql), Attempt.dispatched_at < bindparam("resend_before")),
    )
    for postgresql in (False, True)
}
