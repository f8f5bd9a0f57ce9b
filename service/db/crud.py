"""Data access: every query and commit of the service lives here. Routes check access and call these.

The statements on the path of every job's start (the scheduler's pass, the worker's claim) are
built once, as `_UPPER_CASE` constants with bind parameters: building a SQLAlchemy statement takes
more CPU than the database takes to run one of these (bench/dispatch_latency.py).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import TextClause, bindparam, case, delete, func, or_, select, text, union_all, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, contains_eager, joinedload, lazyload

from api_schemas import AttemptStatus, JobEventType, JobSpec, JobStatus
from service import state
from service import rollups
from service.db.models import TOP_LEVEL, Attempt, Checkpoint, Job, JobEvent, LogLine, Metric, MetricBucket, Upload, User, WorkerHost, utcnow
from service.doorbell import ring

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


def create_user(
    session: Session, name: str, *, is_admin: bool = False, can_run_code: bool = False, token: str | None = None
) -> tuple[User, str]:
    """Create a user and return it with its token; only the token's hash is stored.

    Tokens start with "ty_": a bare token_urlsafe can start with "-", which a command line then
    takes for an option (`--token -abc…`), and the prefix lets secret scanners recognise a leak."""
    token = token or "ty_" + secrets.token_urlsafe(32)
    user = User(name=name, token_hash=hash_token(token), is_admin=is_admin, can_run_code=can_run_code)
    session.add(user)
    session.commit()
    return user, token


def set_can_run_code(session: Session, user: User, allowed: bool) -> None:
    user.can_run_code = allowed
    session.commit()


def user_by_name(session: Session, name: str) -> User | None:
    return session.scalar(select(User).where(User.name == name))


def user_by_token(session: Session, token: str) -> User | None:
    return session.scalar(select(User).where(User.token_hash == hash_token(token)))


# --- uploads -----------------------------------------------------------------------------------

def create_upload(session: Session, owner: User, kind: str, name: str, sha256: str, size_bytes: int, put_in_place) -> Upload:
    """Record an upload; `put_in_place(upload_id)` moves its files to where the id says, before the
    commit, so a committed row always has its files (a failure there rolls the row back)."""
    upload = Upload(owner_id=owner.id, kind=kind, name=name, sha256=sha256, size_bytes=size_bytes, path="")
    session.add(upload)
    session.flush()
    try:
        upload.path = put_in_place(upload.id)
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return upload


def upload_visible_to(session: Session, user: User, upload_id: int, kind: str) -> Upload | None:
    """The upload if it is of `kind` and `user` owns it or is an admin; None otherwise."""
    upload = session.get(Upload, upload_id)
    if upload is None or upload.kind != kind or (upload.owner_id != user.id and not user.is_admin):
        return None
    return upload


def list_uploads(session: Session, user: User, kind: str) -> list[Upload]:
    query = select(Upload).where(Upload.kind == kind).order_by(Upload.id.desc())
    if not user.is_admin:
        query = query.where(Upload.owner_id == user.id)
    return list(session.scalars(query))


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
    by_key = select(Job).where(Job.owner_id == owner.id, Job.idempotency_key == idempotency_key)
    if idempotency_key and (existing := session.scalar(by_key)):
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
        max_steps=spec.training.max_steps or 0,  # 0: a script that didn't say
        idempotency_key=idempotency_key,
    )
    session.add(job)
    try:
        session.flush()
    except IntegrityError:
        if not idempotency_key:
            raise
        # A concurrent retry with the same key inserted first (the unique constraint decided): its job.
        session.rollback()
        return session.scalar(by_key)
    state.append_events(session, job.id, [state.status_event(JobStatus.queued)])
    ring(session)
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

def pg_array(items: list[int | float | str | None]) -> str:
    """A PostgreSQL array literal of numbers (None is NULL) or of strings, for `CAST(:param AS type[])`.

    psycopg dumps a list parameter element by element in Python, a regex per string: for a
    metrics batch that cost more than the statement itself. Floats are finite here (record_metrics
    stores NaN and infinity as None); repr keeps every bit of them."""
    if not items or not isinstance(items[0], str):  # a column of numbers (None among them)
        return "{" + ",".join(map(repr, items)).replace("None", "NULL") + "}"
    quoted = {name: '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"' for name in set(items)}  # a few names, repeated
    return "{" + ",".join(map(quoted.__getitem__, items)) + "}"


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
    steps = [step for step, _ in latest]
    if session.get_bind().dialect.name == "postgresql":
        # The whole batch in one statement of three array parameters, unnested by the server: a
        # row per point would cost a statement (or 5 bind parameters) per point.
        session.execute(_UPSERT_METRIC_ARRAYS, {
            "job_id": job_id, "attempt_id": attempt_id,
            "steps": pg_array(steps), "names": pg_array([name for _, name in latest]), "values": pg_array(list(latest.values())),
        })
    else:
        # SQLite runs in-process: executemany of one cached statement is as fast as it gets there.
        statement = _insert(session)(Metric)
        statement = statement.on_conflict_do_update(
            index_elements=["job_id", "name", "step"],
            set_={"value": statement.excluded.value, "attempt_id": statement.excluded.attempt_id},
        )
        session.execute(statement, [{"job_id": job_id, "attempt_id": attempt_id, "step": s, "name": n, "value": v} for s, n, v in points])
    last_step = max(steps)
    refresh_metric_buckets(session, job_id, points)
    session.execute(update(Job).where(Job.id == job_id, Job.step < last_step).values(step=last_step))
    by_step: dict[int, dict[str, float | None]] = {}
    for step, name, value in points:
        by_step.setdefault(step, {})[name] = value
    state.append_events(session, job_id, [(JobEventType.metrics, {"step": s, "values": v}) for s, v in sorted(by_step.items())])
    session.commit()


def metric_series(
    session: Session, job_id: int, names: list[str] | None, from_step: int | None, max_points: int
) -> dict[str, tuple[list[int], list[float | None]]]:
    """Each series from `from_step` on, downsampled to about `max_points` points, spikes kept
    (service/rollups.py). A long series is read from its bucket summaries, never point by point."""
    # The coarsest summaries say, cheaply, how many points each series has and over which steps.
    top = rollups.LEVELS[-1]
    query = (
        select(MetricBucket.name, func.sum(MetricBucket.count), func.max(MetricBucket.last_step))
        .where(MetricBucket.job_id == job_id, MetricBucket.level == top, MetricBucket.bucket >= (from_step or 0) // rollups.width(top))
        .group_by(MetricBucket.name)
    )
    if names:
        query = query.where(MetricBucket.name.in_(names))
    most_rows = max(2_000, 2 * max_points)
    by_level: dict[int, list[str]] = {}
    for name, count, last_step in session.execute(query):
        span = last_step - (from_step or 0) + 1  # a series has at most one point per step
        level = 0 if min(count, span) <= most_rows else next((lv for lv in rollups.LEVELS if span // rollups.width(lv) < most_rows), top)
        by_level.setdefault(level, []).append(name)

    summaries: dict[str, list[rollups.Summary]] = {}
    for level, level_names in sorted(by_level.items()):
        # Buckets only from the first whole one after from_step; the points before it one by one.
        boundary = -(-(from_step or 0) // rollups.width(level)) * rollups.width(level) if level else None
        points = select(Metric.name, Metric.step, Metric.value).where(Metric.job_id == job_id, Metric.name.in_(level_names))
        if from_step is not None:
            points = points.where(Metric.step >= from_step)
        if boundary is not None:
            points = points.where(Metric.step < boundary)
        for name, step, value in session.execute(points.order_by(Metric.name, Metric.step)).all():
            summaries.setdefault(name, []).append(rollups.Summary.of_point(step, value))
        if level:
            for name, _, _, summary in _bucket_rows(session, job_id, level_names, {(level, boundary // rollups.width(level), 2**31 - 1)}):
                summaries.setdefault(name, []).append(summary)
    return {name: rollups.downsample(series, max_points) for name, series in summaries.items()}


def refresh_metric_buckets(session: Session, job_id: int, points: list[tuple[int, str, float | None]] | None = None) -> None:
    """Bring the bucket summaries of every level up to date with `points` (step, name, value) just
    stored, or rebuild all of the job's from its stored points when None. Not committed: part of
    the caller's write.

    Each touched bucket is made of what lies one level down: the batch's points or the buckets
    just recomputed, and the stored ones beside them (read in two statements)."""
    if points is not None and session.get_bind().dialect.name == "postgresql":
        return _refresh_buckets_in_sql(session, job_id, points)
    if points is None:
        points = session.execute(select(Metric.step, Metric.name, Metric.value).where(Metric.job_id == job_id)).all()
    values: dict[str, dict[int, float | None]] = {}  # name → step → value
    for step, name, value in points:
        values.setdefault(name, {})[step] = value
    names, fanout = sorted(values), rollups.FANOUT
    # The buckets the batch falls in, level by level: a bucket's parent is its number // fanout.
    touched: dict[int, dict[str, list[int]]] = {}
    keys: dict[str, Iterable[int]] = values  # steps, then the buckets of the level below
    for level in rollups.LEVELS:
        touched[level] = keys = {name: sorted({key // fanout for key in below}) for name, below in keys.items()}
    # The stored points of the level-1 buckets the batch covers only in part.
    partial = {
        (0, bucket * fanout, bucket * fanout + fanout - 1)
        for name, buckets in touched[1].items()
        for bucket in buckets
        if any(step not in values[name] for step in range(bucket * fanout, bucket * fanout + fanout))
    }
    if partial:
        # A UNION of one index range scan per run of buckets: under an OR, PostgreSQL pulls the
        # shared `job_id = … AND name IN …` out and scans every point of the job.
        per_range = [
            select(Metric.step, Metric.name, Metric.value).where(Metric.job_id == job_id, Metric.name.in_(names), Metric.step.between(low, high))
            for _, low, high in _coalesce(partial)
        ]
        for step, name, value in session.execute(union_all(*per_range)):
            values[name].setdefault(step, value)
    # The stored buckets one level below each touched bucket of level 2 and up.
    below = {(level - 1, bucket * fanout, bucket * fanout + fanout - 1) for level in rollups.LEVELS[1:] for buckets in touched[level].values() for bucket in buckets}
    finer: dict[int, dict[str, dict[int, rollups.Summary]]] = {level: {name: {} for name in names} for level in rollups.LEVELS}
    for name, level, bucket, summary in _bucket_rows(session, job_id, names, below):
        finer[level][name][bucket] = summary

    rows = []
    for level in rollups.LEVELS:
        for name, buckets in touched[level].items():
            for bucket in buckets:
                keys = range(bucket * fanout, bucket * fanout + fanout)
                if level == 1:
                    summary = rollups.Summary.of_points([(step, values[name][step]) for step in keys if step in values[name]])
                else:
                    summary = rollups.merge([finer[level - 1][name][key] for key in keys if key in finer[level - 1][name]])
                finer[level][name][bucket] = summary  # what the level above is made of
                rows.append({"job_id": job_id, "name": name, "level": level, "bucket": bucket, **vars(summary)})
    _upsert_buckets(session, rows)


def _refresh_buckets_in_sql(session: Session, job_id: int, points: list[tuple[int, str, float | None]]) -> None:
    """refresh_metric_buckets on PostgreSQL: each level's touched buckets recomputed by the server
    from the level below, in one statement per level. The same summaries as rollups.Summary and
    rollups.merge (tests/service/test_metric_rollups.py compares them with a rebuild in Python),
    without carrying the stored neighbours to Python and back (10.8 → ~4 ms of a 2,100-point batch)."""
    keys = {(name, step // rollups.FANOUT) for step, name, _ in points}
    for level in rollups.LEVELS:
        if level > 1:
            keys = {(name, bucket // rollups.FANOUT) for name, bucket in keys}  # a bucket's parent: its number // fanout
        names, buckets = zip(*keys)
        session.execute(_SUMMARISE_POINTS if level == 1 else _MERGE_BUCKETS, {
            "job_id": job_id, "level": level, "names": pg_array(list(names)), "buckets": pg_array(list(buckets)),
        })


def _upsert_buckets(session: Session, rows: list[dict]) -> None:
    if not rows:
        return
    if session.get_bind().dialect.name == "postgresql":
        # One statement of a column array each, as for the points (record_metrics).
        session.execute(_UPSERT_BUCKET_ARRAYS, {column: pg_array([row[column] for row in rows]) for column in _BUCKET_COLUMNS})
        return
    statement = _insert(session)(MetricBucket)
    key, summary = _BUCKET_COLUMNS[:4], _BUCKET_COLUMNS[4:]
    session.execute(statement.on_conflict_do_update(index_elements=key, set_={c: statement.excluded[c] for c in summary}), rows)


_BUCKET_ARRAY_TYPES = {"job_id": "bigint", "name": "varchar", "min_value": "double precision", "max_value": "double precision", "last_value": "double precision"}
_BUCKET_COLUMNS = ["job_id", "name", "level", "bucket", *rollups.Summary.__dataclass_fields__]
_ON_BUCKET_CONFLICT = f"ON CONFLICT (job_id, name, level, bucket) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in _BUCKET_COLUMNS[4:])}"
_UPSERT_BUCKET_ARRAYS = text(f"""
    INSERT INTO metric_buckets ({", ".join(_BUCKET_COLUMNS)})
    SELECT * FROM unnest({", ".join(f"CAST(:{c} AS {_BUCKET_ARRAY_TYPES.get(c, 'integer')}[])" for c in _BUCKET_COLUMNS)})
    {_ON_BUCKET_CONFLICT}
""")


# Each touched bucket of a level summarised from what lies in it one level down. The summary is a
# LATERAL aggregate, so each bucket is one index range scan: as a plain join, the planner hashes
# every point of the job (143 ms at 128k points, growing with the run). The lowest, highest and last
# points are the min or max of [value, step] (of [step, value] for the last) arrays, which order
# as rollups does (ties to the earlier step) without sorting each bucket. A NaN is stored as NULL.
def _summarise_touched(below: str, key: str, summary: str) -> TextClause:
    """The upsert of a level's touched buckets (:names and :buckets), each summarised from the rows
    of `below` (points, or the buckets one level down) whose `key` falls in it."""
    scope = " AND level = :level - 1" if below == "metric_buckets" else ""
    return text(f"""
    INSERT INTO metric_buckets ({", ".join(_BUCKET_COLUMNS)})
    SELECT :job_id, touched.name, :level, touched.bucket, summary.count, summary.first_step,
           summary.low[2]::integer, summary.low[1], (-summary.high[2])::integer, summary.high[1],
           summary.last[1]::integer, summary.last[2], summary.null_step
    FROM unnest(CAST(:names AS varchar[]), CAST(:buckets AS integer[])) AS touched(name, bucket)
    CROSS JOIN LATERAL (SELECT {summary} FROM {below}
        WHERE job_id = :job_id AND name = touched.name{scope}
          AND {key} BETWEEN touched.bucket * {rollups.FANOUT} AND touched.bucket * {rollups.FANOUT} + {rollups.FANOUT - 1}) AS summary
    WHERE summary.count > 0
    {_ON_BUCKET_CONFLICT}
    """)


_SUMMARISE_POINTS = _summarise_touched("metrics", "step", """count(*) AS count, min(step) AS first_step,
    min(ARRAY[value, step]) FILTER (WHERE value IS NOT NULL) AS low,
    max(ARRAY[value, -step]) FILTER (WHERE value IS NOT NULL) AS high,
    max(ARRAY[step, value]) AS last, min(step) FILTER (WHERE value IS NULL) AS null_step""")
_MERGE_BUCKETS = _summarise_touched("metric_buckets", "bucket", """sum(count) AS count, min(first_step) AS first_step,
    min(ARRAY[min_value, min_step]) FILTER (WHERE min_step IS NOT NULL) AS low,
    max(ARRAY[max_value, -max_step]) FILTER (WHERE max_step IS NOT NULL) AS high,
    max(ARRAY[last_step, last_value]) AS last, min(null_step) AS null_step""")


def _coalesce(ranges: set[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(level, first, last) ranges with adjacent and overlapping ones of a level joined: a batch
    touches a run of buckets, which one BETWEEN covers."""
    joined: list[tuple[int, int, int]] = []
    for level, low, high in sorted(ranges):
        if joined and joined[-1][0] == level and low <= joined[-1][2] + 1:
            joined[-1] = (level, joined[-1][1], max(high, joined[-1][2]))
        else:
            joined.append((level, low, high))
    return joined


def _bucket_rows(
    session: Session, job_id: int, names: list[str] | None, ranges: set[tuple[int, int, int]]
) -> list[tuple[str, int, int, rollups.Summary]]:
    """(name, level, bucket, summary) of the stored buckets in `ranges` of (level, first, last
    bucket), in name and bucket order."""
    if not ranges:
        return []
    # Plain rows, not ORM objects: a chart reads thousands of these per request.
    columns = [getattr(MetricBucket, field) for field in rollups.Summary.__dataclass_fields__]
    # One index range scan per run of buckets (see refresh_metric_buckets on OR and UNION).
    per_range = []
    for level, low, high in _coalesce(ranges):
        query = select(MetricBucket.name, MetricBucket.level, MetricBucket.bucket, *columns).where(
            MetricBucket.job_id == job_id, MetricBucket.level == level, MetricBucket.bucket.between(low, high)
        )
        per_range.append(query.where(MetricBucket.name.in_(names)) if names else query)
    rows = session.execute(union_all(*per_range).order_by("name", "level", "bucket")).all()  # one fetch, not one per row
    return [(name, level, bucket, rollups.Summary(*summary)) for name, level, bucket, *summary in rows]


def record_logs(session: Session, job_id: int, attempt: ClaimedAttempt, lines: list[tuple[int, int | None, str]]) -> None:
    """Store (seq, rank, line) triples of an attempt's output; re-sent lines are ignored."""
    if not lines:
        return
    lock_job_logs(session, job_id)
    insert = _insert(session)
    rows = [
        {"job_id": job_id, "attempt_id": attempt.attempt_id, "attempt_number": attempt.number, "seq": seq, "rank": rank, "line": line}
        for seq, rank, line in lines
    ]
    session.execute(insert(LogLine).values(rows).on_conflict_do_nothing(index_elements=["attempt_id", "seq"]))
    session.commit()


def lock_job_logs(session: Session, job_id: int) -> None:
    """Make a job's log writers (the nodes of a gang) take turns until commit (PostgreSQL; SQLite
    writers already do): line ids are then handed out in commit order, so a reader that has seen
    line n never misses a line below n committed later (cursors and followed logs rely on it)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('trainyard-logs', :job_id))"), {"job_id": job_id})


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


def last_event_seq(session: Session, job_id: int) -> int:
    """The seq of the job's latest event; 0 before any."""
    return session.scalar(select(func.coalesce(func.max(JobEvent.seq), 0)).where(JobEvent.job_id == job_id))


def last_log_line_id(session: Session, job_id: int) -> int:
    """The id of the job's latest stored log line; 0 before any."""
    return session.scalar(select(func.coalesce(func.max(LogLine.id), 0)).where(LogLine.job_id == job_id))


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
    ring(session)  # a new host may fit jobs that are waiting
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
    # The job and the checkpoint to resume from in the same read, the job's other attempts only if
    # a rule needs them: a claim is on the path of every job's start.
    row = session.execute(_ATTEMPT_TO_CLAIM, {"attempt_id": attempt_id}).first()
    attempt, checkpoint = row if row is not None else (None, None)
    if attempt is None or attempt.status != AttemptStatus.scheduled:
        session.rollback()
        return None
    job = attempt.job
    if job.cancel_requested:
        state.end_attempt(session, job, attempt, AttemptStatus.cancelled, reason="cancelled before start")
        session.commit()
        return None
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
    # The first node of a gang to start moves the job to running, at the step it resumes from; the
    # others find it there.
    job_running = job.status == JobStatus.running or state.move_job(
        session, job, JobStatus.running, now=now, step=checkpoint.step if checkpoint else 0
    )
    if not claimed or not job_running:
        session.rollback()
        return None
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


_newest = aliased(Checkpoint)
_ATTEMPT_TO_CLAIM = (
    select(Attempt, Checkpoint)
    .options(joinedload(Attempt.job).options(lazyload(Job.attempts), lazyload(Job.owner)))
    .outerjoin(Checkpoint, (Checkpoint.job_id == Attempt.job_id) & (Checkpoint.step == (
        select(func.max(_newest.step)).where(_newest.job_id == Attempt.job_id).scalar_subquery()
    )))
    .where(Attempt.id == bindparam("attempt_id"))
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


_ONLINE_HOSTS_WITH_LOAD = (
    select(WorkerHost, Attempt.slots, Attempt.device_ids)
    .outerjoin(Attempt, (Attempt.host_name == WorkerHost.name) & Attempt.status.in_(ACTIVE_ATTEMPT))
    .where(WorkerHost.last_heartbeat >= bindparam("cutoff"))
    .order_by(WorkerHost.name)
)


def online_hosts_with_load(
    session: Session, now: datetime, host_timeout: float
) -> tuple[list[WorkerHost], dict[str, int], dict[str, set[int]]]:
    """The online hosts with the process slots and GPU indices their active attempts hold: one
    read for what a scheduler pass places by (a host and each of its active attempts per row)."""
    rows = session.execute(_ONLINE_HOSTS_WITH_LOAD, {"cutoff": now - timedelta(seconds=host_timeout)}).all()
    hosts = list(dict.fromkeys(host for host, _, _ in rows))
    return (hosts, *_sum_busy((host.name, used, device_ids) for host, used, device_ids in rows if used is not None))


def _sum_busy(attempts: Iterable[tuple[str, int, list[int] | None]]) -> tuple[dict[str, int], dict[str, set[int]]]:
    slots: dict[str, int] = {}
    gpus: dict[str, set[int]] = {}
    for host, used, device_ids in attempts:
        slots[host] = slots.get(host, 0) + used
        if device_ids:
            gpus.setdefault(host, set()).update(device_ids)
    return slots, gpus


def busy_slots_by_host(session: Session) -> dict[str, int]:
    """Process slots that active attempts hold, per host, online or not."""
    active = select(Attempt.host_name, Attempt.slots, Attempt.device_ids).where(Attempt.status.in_(ACTIVE_ATTEMPT))
    return _sum_busy(session.execute(active))[0]


def preemptible_attempts(session: Session) -> list[Attempt]:
    """Running attempts of preemptible jobs, including those already asked to stop."""
    # With their jobs in the same read: one query, not one more per running attempt.
    query = select(Attempt).join(Attempt.job).options(contains_eager(Attempt.job)).where(Attempt.status == AttemptStatus.running)
    return [attempt for attempt in session.scalars(query) if attempt.job.spec.get("preemptible")]


def request_preemption(attempt: Attempt) -> None:
    """Its worker sees this at the next lease renewal and stops it at a checkpoint."""
    attempt.preempt_requested = True


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


def create_attempts(
    session: Session, job: Job, placements: list[tuple[str, list[int] | None]], slots: int, now: datetime
) -> list[PlacedAttempt]:
    """place_jobs for one job: its attempts, [] if the job was taken meanwhile."""
    return place_jobs(session, [(job, placements, slots)], now)


@dataclass(frozen=True)
class PlacedAttempt:
    id: int
    job_id: int
    number: int
    host_name: str


def place_jobs(
    session: Session, placements: list[tuple[Job, list[tuple[str, list[int] | None]], int]], now: datetime
) -> list[PlacedAttempt]:
    """Place queued jobs, each on its hosts at once (one attempt per node, node 0 first, each with
    the GPU indices reserved for it there, None or [] on CPU): each job moves to `scheduled` and
    gets new scheduled attempts sharing one number, with `slots` slots each. A job another process
    took meanwhile gets none. Returns the attempts created.

    Read the jobs in this transaction (queued_jobs does): their row locks then keep anyone else
    from placing them too until commit."""
    next_number = state.schedule_jobs(session, [job for job, _, _ in placements], now=now)
    rows = [
        {"job_id": job.id, "number": next_number[job.id], "node_rank": rank, "host_name": host, "slots": slots,
         "device_ids": gpus or None, "status": AttemptStatus.scheduled, "dispatched_at": now}
        for job, hosts, slots in placements if job.id in next_number
        for rank, (host, gpus) in enumerate(hosts)
    ]
    if not rows:
        return []
    # One INSERT for all of them, which gives them their ids; a Core insert, as the ORM's unit of
    # work took as much CPU as moving the jobs to scheduled.
    attempts = Attempt.__table__
    ids = session.scalars(attempts.insert().returning(attempts.c.id, sort_by_parameter_order=True), rows).all()
    return [PlacedAttempt(id, row["job_id"], row["number"], row["host_name"]) for id, row in zip(ids, rows)]


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
