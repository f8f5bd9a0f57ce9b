"""The one place job and attempt statuses change.

Every change is a compare-and-set: `UPDATE … WHERE id = :id AND status = :current`. If another
process (a second scheduler, a duplicate task delivery, the lease reaper) moved the row first, the
update matches nothing and the caller learns it lost the race instead of overwriting a newer state.

A job's status change is appended to its event log (`append_events`, which metrics and checkpoints
use too) in the same transaction, so the log holds exactly the changes that committed.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

from sqlalchemy import bindparam, case, func, literal_column, select, text, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from api_schemas import AttemptStatus, JobEventType, JobSpec, JobStatus
from api_schemas.host_api import Rollback
from service.db.dialect import Statement, is_postgresql, list_param, one_of
from service.db.doorbell import followers_told, ring, tell_followers
from service.db.models import Attempt, Job, JobEvent, utcnow

ACTIVE_JOB = (JobStatus.queued, JobStatus.scheduled, JobStatus.running)
ACTIVE_ATTEMPT = (AttemptStatus.scheduled, AttemptStatus.running)
# Tries of a job that end one after the other before starting (their host lost before it claimed,
# a batch job gone from the cluster's queue) use no restart; this many in a row fail the job.
MAX_NEVER_STARTED_IN_A_ROW = 5

JOB_TRANSITIONS: dict[JobStatus, set[JobStatus]] = {
    JobStatus.queued: {JobStatus.scheduled, JobStatus.cancelled, JobStatus.failed, JobStatus.pruned},
    JobStatus.scheduled: {JobStatus.running, JobStatus.queued, JobStatus.failed, JobStatus.cancelled, JobStatus.pruned},
    JobStatus.running: {JobStatus.succeeded, JobStatus.failed, JobStatus.queued, JobStatus.cancelled, JobStatus.pruned},
    JobStatus.succeeded: set(),
    JobStatus.failed: set(),
    JobStatus.cancelled: set(),
    JobStatus.pruned: set(),
}

ATTEMPT_TRANSITIONS: dict[AttemptStatus, set[AttemptStatus]] = {
    AttemptStatus.scheduled: {AttemptStatus.running, AttemptStatus.lost, AttemptStatus.cancelled, AttemptStatus.failed},
    AttemptStatus.running: {
        AttemptStatus.succeeded, AttemptStatus.failed, AttemptStatus.lost, AttemptStatus.preempted, AttemptStatus.cancelled,
    },
    AttemptStatus.succeeded: set(),
    AttemptStatus.failed: set(),
    AttemptStatus.lost: set(),
    AttemptStatus.preempted: set(),
    AttemptStatus.cancelled: set(),
}


class InvalidTransition(Exception):
    pass


def _compare_and_set(session: Session, row: Job | Attempt, to, allowed: dict, values: dict) -> bool:
    current = row.status
    if to not in allowed[current]:
        raise InvalidTransition(f"{type(row).__name__} {row.id}: {current.value} -> {to.value} is not allowed")
    session.flush()  # pending changes to the row first, as an ORM UPDATE's autoflush did: a lost race refreshes it
    model = type(row)
    parameters = {"row_id": row.id, "current": current, "to": to, **{f"new_{key}": value for key, value in values.items()}}
    result = session.execute(_cas_statement(model, tuple(sorted(values))), parameters)
    if model is Job:
        event_seq = result.scalar_one_or_none()
        won = event_seq is not None
    else:
        won = result.rowcount == 1
    if not won:
        session.refresh(row)
        return False
    # The row holds these values now: record them as loaded, not as pending changes, or the next
    # flush would write the same values again with an UPDATE of its own.
    set_committed_value(row, "status", to)
    for key, value in values.items():
        set_committed_value(row, key, value)
    if model is Job:
        set_committed_value(row, "last_event_seq", event_seq)
    return True


@functools.cache
def _cas_statement(model: type[Job] | type[Attempt], keys: tuple[str, ...]):
    """The compare-and-set UPDATE that sets these columns, built once per set of columns, as the
    statements on the path of a job's start are (see service/db/__init__.py)."""
    # On the table, not the mapped class: an ORM-enabled UPDATE costs about twice the client CPU,
    # and the caller records the new values on the row itself (set_committed_value).
    table = model.__table__
    statement = (
        update(table)
        .where(table.c.id == bindparam("row_id"), table.c.status == bindparam("current"))
        .values(status=bindparam("to"), **{key: bindparam(f"new_{key}") for key in keys})
    )
    if model is Job:
        # The status event's number is taken in the same UPDATE (see append_events): one round trip, not two.
        statement = statement.values(last_event_seq=table.c.last_event_seq + 1).returning(table.c.last_event_seq)
    return statement


def move_job(
    session: Session, job: Job, to: JobStatus, *, reason: str | None = None, now: datetime | None = None, **values
) -> bool:
    """Move a job to `to`, setting `values` with it; False if another process changed its status first."""
    now = now or utcnow()
    if to == JobStatus.queued:
        values["queued_at"] = now  # an elastic job's wait for its full size starts again
    if to == JobStatus.running and job.started_at is None:
        values["started_at"] = now
    if to.is_final:
        values["finished_at"] = now
    if reason is not None:
        values["failure_reason"] = reason
    elif to == JobStatus.succeeded:
        values["failure_reason"] = None  # an earlier attempt's failure is the attempt's, not the job's
    if not _compare_and_set(session, job, to, JOB_TRANSITIONS, values):
        return False
    _insert_events(session, job.id, job.last_event_seq, [status_event(to, reason)], now)
    if to == JobStatus.queued:
        ring(session)  # back in the queue: place it now, not at the next poll
    return True


def schedule_jobs(session: Session, jobs: list[Job], *, now: datetime) -> dict[int, int]:
    """Move queued jobs to `scheduled` all at once: move_job's compare-and-set and status event for
    many jobs in two statements, so placing a backlog costs a few round trips, not a few per job.
    Returns {job id: the number its new attempts take} for the jobs that moved; a job another
    process changed first is left out."""
    if not jobs:
        return {}
    for job in jobs:
        if JobStatus.scheduled not in JOB_TRANSITIONS[job.status]:
            raise InvalidTransition(f"Job {job.id}: {job.status.value} -> scheduled is not allowed")
    # Taking each job's next event number in the same UPDATE keeps its log gapless and in commit
    # order, as append_events does: the row stays locked until this transaction ends. The next
    # attempt number comes back with it, so the pass never loads a job's earlier attempts; only
    # a placement adds attempts, and it holds this lock.
    session.flush()  # as in _compare_and_set
    postgresql = is_postgresql(session)
    moved = {
        job_id: (seq, number)
        for job_id, seq, number in session.execute(_SCHEDULE_JOBS[postgresql], {"ids": list_param([job.id for job in jobs], postgresql)})
    }
    for job in jobs:
        if job.id in moved:
            set_committed_value(job, "status", JobStatus.scheduled)
            set_committed_value(job, "last_event_seq", moved[job.id][0])
            set_committed_value(job, "waiting_reason", None)
        else:
            session.refresh(job)
    kind, data = status_event(JobStatus.scheduled)
    if postgresql:  # one statement, the numbers as one JSON array: psycopg's executemany is a round trip per row
        numbers = json.dumps([{"job_id": job_id, "seq": seq} for job_id, (seq, _) in moved.items()])
        session.execute(_INSERT_STATUS_EVENTS_JSON, {"numbers": numbers, "type": kind.value, "data": json.dumps(data), "at": now})
    else:
        rows = [{"job_id": job_id, "seq": seq, "type": kind, "data": data, "created_at": now} for job_id, (seq, _) in moved.items()]
        session.execute(JobEvent.__table__.insert(), rows)  # Core: the ORM's bulk insert costs more CPU than the round trip
    return {job_id: number for job_id, (_, number) in moved.items()}


_INSERT_STATUS_EVENTS_JSON = text("""
    INSERT INTO job_events (job_id, seq, type, data, created_at)
    SELECT n.job_id, n.seq, :type, CAST(:data AS json), :at
    FROM json_to_recordset(CAST(:numbers AS json)) AS n(job_id bigint, seq int)
""")


_jobs = Job.__table__
_SCHEDULE_JOBS = {  # on the table, as _cas_statement's; by whether the database is PostgreSQL
    postgresql: update(_jobs)
    .where(one_of(_jobs.c.id, "ids", postgresql), _jobs.c.status == JobStatus.queued)
    .values(status=JobStatus.scheduled, last_event_seq=_jobs.c.last_event_seq + 1, waiting_reason=None)
    # jobs.id spelled out: SQLite's RETURNING names columns unqualified, and a bare `id` in the
    # subquery would be the attempt's.
    .returning(_jobs.c.id, _jobs.c.last_event_seq, select(func.coalesce(func.max(Attempt.number), 0) + 1).where(Attempt.job_id == literal_column("jobs.id")).scalar_subquery())
    for postgresql in (False, True)
}
# A job's next event numbers: the counter after taking `count` of them; its step raised to `at_least` (when not null).
_TAKE_EVENT_NUMBERS = (
    update(_jobs)
    .where(_jobs.c.id == bindparam("job_id"))
    .values(
        last_event_seq=_jobs.c.last_event_seq + bindparam("count"),
        step=case((_jobs.c.step < bindparam("at_least"), bindparam("at_least")), else_=_jobs.c.step),
    )
    .returning(_jobs.c.last_event_seq)
)


def move_attempt(
    session: Session, attempt: Attempt, to: AttemptStatus, *, reason: str | None = None, now: datetime | None = None, **values
) -> bool:
    """Move an attempt to `to`; False if another process changed its status first."""
    now = now or utcnow()
    if to == AttemptStatus.running:
        values["started_at"] = now
    if to.is_final:
        values["finished_at"] = now
        values["lease_expires_at"] = None
    if reason is not None:
        values["failure_reason"] = reason
    if not _compare_and_set(session, attempt, to, ATTEMPT_TRANSITIONS, values):
        return False
    if to.is_final:
        ring(session)  # its devices are free for the next queued job
    return True


def end_attempt(
    session: Session, job: Job, attempt: Attempt, outcome: AttemptStatus, reason: str | None = None, *, retry: bool = True,
    rollback: Rollback | None = None,
) -> bool:
    """Record how an attempt ended and decide what its job does next.

    succeeded → job succeeded (a multi-node gang: once every node has). Any other end of one node
    ends the rest of its gang as failed (cancelled, when the job's cancel was asked for; preempted,
    when it was preempted): they cannot go on without it; their workers see their lease gone and
    stop. cancelled, or any end of a job whose cancel was requested → job cancelled. Any other end
    of a job its sweep pruned (see request_prune) → job pruned. preempted →
    queued again, using no restart (the job did nothing wrong); with `rollback` (its loss guard stopped
    it), the same with a `rollback` event while the job has rollbacks left (training.guard.max_rollbacks),
    else the attempt and the job fail, saying why, using no restart. failed or lost → queued again
    while restarts remain, else failed with the attempt's reason; failed with `retry=False` (the
    job's own spec can't run: every attempt would fail the same) → failed at once, using no restart.
    A queued job resumes from its latest complete checkpoint.
    """
    # The job's row first: two nodes of a gang ending at once each read the other as still running
    # (before the other committed) and neither ended the job, which stayed `running` for good (found
    # on PostgreSQL, the nodes 1 ms apart). Locked, they take turns, and the gang is read after the lock.
    session.execute(select(Job.id).where(Job.id == job.id).with_for_update())
    if rollback is not None and job.rollbacks >= (allowed := JobSpec.from_stored(job.spec).training.guard.max_rollbacks):
        # No rollback left: the spike ends the job, as a failure no retry mends.
        outcome, retry, rollback = AttemptStatus.failed, False, None
        if allowed == 0:
            reason = f"{reason}; not rolled back (training.guard.max_rollbacks is 0)"
        else:
            # A hint only: a spike at the same steps again is the run's own; at other steps, other data.
            reason = (
                f"{reason}; not rolled back again, after {allowed} rollback{'s' if allowed != 1 else ''} (training.guard.max_rollbacks). "
                "If it spiked at the same place each time, the cause is likely the run's own (learning rate, precision), not its data's"
            )
    if not move_attempt(session, attempt, outcome, reason=reason):
        return False
    gang = [other for other in job.attempts if other.number == attempt.number and other.id != attempt.id]
    for other in gang:
        session.refresh(other, ["status"])
    if outcome == AttemptStatus.succeeded:
        if any(other.status != AttemptStatus.succeeded for other in gang):
            return True
        return move_job(session, job, JobStatus.succeeded)
    cancelled = outcome == AttemptStatus.cancelled or job.cancel_requested
    for other in gang:
        if not other.status.is_final:
            if cancelled:
                ended = AttemptStatus.cancelled
            elif outcome == AttemptStatus.preempted and other.status == AttemptStatus.running:
                ended = AttemptStatus.preempted  # its ranks voted to stop at the same checkpoint
            else:
                ended = AttemptStatus.failed
            move_attempt(session, other, ended, reason=f"node {attempt.node_rank} of this gang ended {outcome.value}: {reason}")
    if cancelled:  # said as a queued job's cancel says it, over an earlier attempt's "retrying after …"
        return move_job(session, job, JobStatus.cancelled, reason="cancelled by user")
    if job.prune_reason is not None:
        return move_job(session, job, JobStatus.pruned, reason=job.prune_reason)
    if outcome == AttemptStatus.preempted and rollback is not None:
        return _roll_back(session, job, attempt, rollback)
    if outcome == AttemptStatus.preempted:
        return move_job(session, job, JobStatus.queued, reason=f"attempt {attempt.number} preempted: {reason}")
    which = f"attempt {attempt.number}" + (f" node {attempt.node_rank}" if gang else "")
    if not retry:
        return move_job(session, job, JobStatus.failed, reason=f"{which} {outcome.value}, not retried: {reason}")
    # An attempt that never started used no restart: its host vanished before it claimed it. But
    # not for ever: tries that all end so, one after the other (a cluster that loses every batch job
    # it is handed, a host that dies at each claim), fail the job instead of placing it again without end.
    if attempt.started_at is not None:
        job.restarts += 1
    elif (unstarted := never_started_in_a_row(job)) >= MAX_NEVER_STARTED_IN_A_ROW:
        return move_job(session, job, JobStatus.failed, reason=f"{which} {outcome.value}: {reason}; its last {unstarted} tries all ended before starting")
    if job.restarts <= job.spec.get("max_restarts", 0):
        return move_job(session, job, JobStatus.queued, reason=f"retrying after {which}: {reason}")
    return move_job(session, job, JobStatus.failed, reason=f"{which} {outcome.value}: {reason}")


def never_started_in_a_row(job: Job) -> int:
    """How many of the job's last tries ended without starting, the latest first (one that started breaks the run)."""
    tries: dict[int, list[Attempt]] = {}
    for attempt in job.attempts:
        tries.setdefault(attempt.number, []).append(attempt)
    count = 0
    for number in sorted(tries, reverse=True):
        if any(attempt.started_at is not None or not attempt.status.is_final for attempt in tries[number]):
            break
        count += 1
    return count


def _roll_back(session: Session, job: Job, attempt: Attempt, rollback: Rollback) -> bool:
    job.rollbacks += 1
    resume_step = (job.rollback_skip or {}).get("resume_step", 0)
    data = {**rollback.model_dump(exclude={"drop"}), "resume_step": resume_step, "rollbacks": job.rollbacks}
    append_events(session, job.id, [(JobEventType.rollback, data)])
    past = (
        f"past the batches of steps {resume_step + 1}-{rollback.last_step}" if rollback.drop is None
        else "through its own resume (skipping data is its own)"  # a script's or custom loop's
    )
    return move_job(session, job, JobStatus.queued, reason=(
        f"attempt {attempt.number} rolled back by the loss guard: {rollback.reason}; resuming from step {resume_step}, {past}"
    ))


def request_prune(session: Session, job: Job, reason: str) -> None:
    """End a sweep's trial early. A queued job is pruned at once; a placed or running one is asked
    to stop as a preemption is (its worker sees the request at its next lease renewal, and the
    training checkpoints and stops), and end_attempt then ends the job `pruned`, its checkpoints kept."""
    if job.status == JobStatus.queued:
        move_job(session, job, JobStatus.pruned, reason=reason)
        return
    job.prune_reason = reason
    for attempt in job.attempts:
        if not attempt.status.is_final:
            attempt.preempt_requested = True


def status_event(status: JobStatus, reason: str | None = None) -> tuple[JobEventType, dict]:
    return JobEventType.status, {"status": status.value, "reason": reason}


def append_events(
    session: Session, job_id: int, events: list[tuple[JobEventType, dict]], *, now: datetime | None = None, step: int | None = None
) -> None:
    """Append (type, data) events to the job's log, numbered on from its `last_event_seq`; with
    `step`, the job's step is raised to it in the same statement (a metrics report's last step).

    The counter's UPDATE locks the job row until this transaction ends, so a concurrent writer
    numbers its events after ours and commits after us: seq stays gapless and in commit order.
    """
    if not events:
        return
    last = session.execute(_TAKE_EVENT_NUMBERS, {"job_id": job_id, "count": len(events), "at_least": step}).scalar_one()
    _insert_events(session, job_id, last - len(events) + 1, events, now or utcnow())


def metric_event_statements(job_id: int, arrays: dict, step_count: int, last_step: int) -> list[Statement]:
    """append_events of a metrics batch on PostgreSQL, as statements to run once its points are
    stored (service/db/metrics.py): its events (one for each of its `step_count` steps, as the batch's
    arrays `steps`, `names` and `values` say) built by the server, numbered from the job's counter in the same statement,
    and the followers told. Nothing is read back, so the batch goes in one round trip."""
    parameters = {**arrays, "job_id": job_id, "count": step_count, "at_least": last_step, "type": JobEventType.metrics.value, "at": utcnow()}
    return [(_INSERT_METRIC_EVENTS, parameters), followers_told(job_id)]


# As _TAKE_EVENT_NUMBERS then _INSERT_EVENTS_JSON, with each step's event made of its points:
# {"step": 7, "values": {"train_loss": 2.1, "lr": 0.001}}, a NaN (stored as NULL) as null.
_INSERT_METRIC_EVENTS = text("""
    WITH numbered AS (
        UPDATE jobs SET last_event_seq = last_event_seq + :count, step = GREATEST(step, :at_least)
        WHERE id = :job_id RETURNING last_event_seq
    ), per_step AS (
        SELECT step, json_build_object('step', step, 'values', json_object_agg(name, value)) AS data
        FROM unnest(CAST(:steps AS integer[]), CAST(:names AS varchar[]), CAST(:values AS double precision[])) AS point(step, name, value)
        GROUP BY step
    )
    INSERT INTO job_events (job_id, seq, type, data, created_at)
    SELECT :job_id, numbered.last_event_seq - :count + row_number() OVER (ORDER BY per_step.step), :type, per_step.data, :at
    FROM per_step CROSS JOIN numbered
""")


def _insert_events(session: Session, job_id: int, first: int, events: list[tuple[JobEventType, dict]], at: datetime) -> None:
    """The events numbered `first`, `first` + 1, …: numbers the caller took from the job's counter."""
    tell_followers(session, job_id)
    if len(events) > 1 and session.get_bind().dialect.name == "postgresql":
        # One statement however many events (a metrics batch brings hundreds): the events travel
        # as one JSON array, which the server unpacks. psycopg would send one INSERT per row.
        payload = json.dumps([{"type": kind.value, "data": data} for kind, data in events])
        session.execute(_INSERT_EVENTS_JSON, {"job_id": job_id, "first": first, "events": payload, "at": at})
        return
    rows = [{"job_id": job_id, "seq": first + i, "type": kind, "data": data, "created_at": at} for i, (kind, data) in enumerate(events)]
    session.execute(JobEvent.__table__.insert(), rows)


_INSERT_EVENTS_JSON = text("""
    INSERT INTO job_events (job_id, seq, type, data, created_at)
    SELECT :job_id, :first + event.n - 1, event.value ->> 'type', event.value -> 'data', :at
    FROM json_array_elements(CAST(:events AS json)) WITH ORDINALITY AS event(value, n)
""")
