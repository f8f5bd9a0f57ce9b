"""Metric points: stored as a worker reports them, read back as downsampled series and latest values."""

from __future__ import annotations

import math

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from api_schemas import JobEventType
from service.db import rollups, state
from service.db.dialect import dialect_insert, pg_array, pipelined
from service.db.metric_buckets import bucket_rows, bucket_statements, refresh_metric_buckets
from service.db.models import Metric, MetricBucket


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
        # The whole batch in three array parameters, unnested by the server (a row per point would
        # cost a statement, or 5 bind parameters, per point); stored, summarised into its buckets and
        # made events in one round trip, nothing read back.
        arrays = {"steps": pg_array(steps), "names": pg_array([name for _, name in latest]), "values": pg_array(list(latest.values()))}
        pipelined(session, [
            (_UPSERT_METRIC_ARRAYS, {**arrays, "job_id": job_id, "attempt_id": attempt_id}),
            *bucket_statements(job_id, points),
            *state.metric_event_statements(job_id, arrays, len(set(steps)), max(steps)),
        ])
        session.commit()
        return
    # SQLite runs in-process: executemany of one cached statement is as fast as it gets there.
    statement = dialect_insert(session)(Metric)
    statement = statement.on_conflict_do_update(
        index_elements=["job_id", "name", "step"],
        set_={"value": statement.excluded.value, "attempt_id": statement.excluded.attempt_id},
    )
    session.execute(statement, [{"job_id": job_id, "attempt_id": attempt_id, "step": s, "name": n, "value": v} for s, n, v in points])
    refresh_metric_buckets(session, job_id, points)
    by_step: dict[int, dict[str, float | None]] = {}
    for step, name, value in points:
        by_step.setdefault(step, {})[name] = value
    events = [(JobEventType.metrics, {"step": s, "values": v}) for s, v in sorted(by_step.items())]
    state.append_events(session, job_id, events, step=max(steps))  # the job's step raised in the counter's statement
    session.commit()


def not_stored_yet(session: Session, job_id: int, points: list[tuple[int, str, float]]) -> list[tuple[int, str, float]]:
    """The points not stored already with the same value (a NaN as NULL): what a re-sent report adds."""
    if not points:
        return points
    steps = sorted({step for step, _, _ in points})
    stored = {
        (step, name): value
        for step, name, value in session.execute(
            select(Metric.step, Metric.name, Metric.value).where(Metric.job_id == job_id, Metric.step.between(steps[0], steps[-1]))
        )
    }
    session.commit()
    return [
        (step, name, value) for step, name, value in points
        if (step, name) not in stored or stored[(step, name)] != (value if math.isfinite(value) else None)
    ]


def metric_series(
    session: Session, job_id: int, names: list[str] | None, from_step: int | None, max_points: int
) -> dict[str, tuple[list[int], list[float | None]]]:
    """Each series from `from_step` on, downsampled to about `max_points` points, spikes kept
    (service/db/rollups.py). A long series is read from its bucket summaries, never point by point."""
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
            for name, _, _, summary in bucket_rows(session, job_id, level_names, {(level, boundary // rollups.width(level), 2**31 - 1)}):
                summaries.setdefault(name, []).append(summary)
    return {name: rollups.downsample(series, max_points) for name, series in summaries.items()}


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
