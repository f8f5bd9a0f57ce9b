"""Long metric series: charted from bucket summaries kept at ingest, with every spike kept (SQLite and PostgreSQL)."""

from __future__ import annotations

import random

import pytest
import sqlalchemy as sa
from alembic import command
from sqlalchemy import delete, func, select

from service.db.accounts import create_user
from service.db.jobs import create_job
from service.db.metric_buckets import refresh_metric_buckets
from service.db.metrics import metric_series, record_metrics
from service.db.migrate import alembic_config
from service.db.models import Metric, MetricBucket
from service.db.monitoring import metric_point_count
from service.db.session import session_factory
from tests.helpers import job_spec

STEPS = 20_000
HIGH, LOW, DIVERGED = 12_345, 777, 15_000


@pytest.fixture
def long_run(database_url):
    """A job of 20,000 steps of train_loss and lr, flushed 300 steps at a time as a worker does,
    with a spike up, a spike down and two NaN steps; steps 9,000–9,599 are recomputed after a
    resume with other values. Returns (sessions, job id, the values stored)."""
    sessions, rng = session_factory(database_url), random.Random(0)
    with sessions() as session:
        user = create_user(session, "alice")[0]
        job_id = create_job(session, user, job_spec()).id
    stored: dict[int, float | None] = {}

    def flush(first: int, last: int) -> None:
        batch = []
        for step in range(first, last + 1):
            value = {HIGH: 100.0, LOW: -100.0, DIVERGED: float("nan"), DIVERGED + 1: float("inf")}.get(step, rng.random())
            stored[step] = value if value == value and abs(value) != float("inf") else None
            batch += [(step, "train_loss", value), (step, "lr", 0.001)]
        with sessions() as session:
            record_metrics(session, job_id, 0, batch)

    for first in range(1, STEPS + 1, 300):
        flush(first, min(first + 299, STEPS))
        if first == 9_301:  # the attempt died after step 9,600; its successor resumed from 9,000
            flush(9_000, 9_599)
    return sessions, job_id, stored


def test_a_long_series_is_downsampled_with_its_spikes_divergence_and_last_point_kept(long_run):
    sessions, job_id, stored = long_run
    with sessions() as session:
        steps, values = metric_series(session, job_id, ["train_loss"], None, max_points=300)["train_loss"]
    assert steps == sorted(set(steps)) and len(steps) <= 300 + 100  # a group's first NaN may add a point
    assert all(values[i] == stored[step] for i, step in enumerate(steps))  # real points, not averages
    kept = dict(zip(steps, values))
    assert kept[HIGH] == 100.0 and kept[LOW] == -100.0 and kept[DIVERGED] is None and STEPS in kept


def test_an_incremental_read_from_a_step_returns_exactly_the_points_after_it(long_run):
    sessions, job_id, stored = long_run
    with sessions() as session:
        series = metric_series(session, job_id, None, 19_950, max_points=1000)
        assert series["train_loss"] == (list(range(19_950, STEPS + 1)), [stored[s] for s in range(19_950, STEPS + 1)])
        steps, _ = metric_series(session, job_id, ["train_loss"], 10_001, max_points=300)["train_loss"]
        assert steps[0] >= 10_001 and HIGH in steps and steps[-1] == STEPS


def test_buckets_kept_up_at_ingest_equal_buckets_built_from_scratch(long_run):
    # On PostgreSQL ingest has the server summarise the buckets (SQL) while a rebuild runs
    # service/db/rollups.py: the two must agree, ties (lr is constant), NaNs and recomputed steps included.
    sessions, job_id, _ = long_run
    query = select(MetricBucket).order_by(MetricBucket.name, MetricBucket.level, MetricBucket.bucket)

    def bucket_rows(session) -> list[dict]:
        return [{c.key: getattr(row, c.key) for c in MetricBucket.__table__.columns} for row in session.scalars(query)]

    with sessions() as session:
        incremental = bucket_rows(session)
        session.execute(delete(MetricBucket))
        refresh_metric_buckets(session, job_id)
        session.commit()
        assert bucket_rows(session) == incremental
    assert {row["level"] for row in incremental} == {1, 2, 3, 4}


def test_the_points_total_added_up_from_the_coarsest_summaries_equals_the_points_stored(long_run):
    # /metrics reports it; recomputed steps (9,000–9,599, sent twice) count once.
    sessions, job_id, stored = long_run
    with sessions() as session:
        assert metric_point_count(session) == session.scalar(select(func.count()).select_from(Metric)) == 2 * len(stored)


def test_migration_0004_summarises_the_metrics_stored_before_it_as_ingest_would(empty_database_url):
    # Two jobs' series as the service at revision 0003 stored them, a NaN (NULL) and ties (the
    # constant lr) among them, over buckets of every level (level 4's second starts at 65,536).
    rng = random.Random(1)
    points = {
        job_id: {(step, name): None if step % 97 == 0 else round(rng.uniform(-1, 1), 3) if name == "loss" else 0.5
                 for step in rng.sample(range(70_000), 400) for name in ("loss", "lr")}
        for job_id in (1, 2)
    }
    command.upgrade(alembic_config(empty_database_url), "0003")
    engine = sa.create_engine(empty_database_url)
    with engine.begin() as connection:
        connection.execute(sa.text(
            "INSERT INTO users (id, name, token_hash, is_admin, created_at) VALUES (1, 'alice', 'x', false, CURRENT_TIMESTAMP)"
        ))
        for job_id in points:
            connection.execute(sa.text(
                "INSERT INTO jobs (id, owner_id, name, spec, status, priority, max_steps, step, restarts, cancel_requested, created_at)"
                " VALUES (:id, 1, 'job', '{}', 'running', 0, 70000, 0, 0, false, CURRENT_TIMESTAMP)"
            ), {"id": job_id})
        connection.execute(sa.text("INSERT INTO metrics (job_id, attempt_id, name, step, value) VALUES (:job_id, 1, :name, :step, :value)"), [
            {"job_id": job_id, "step": step, "name": name, "value": value}
            for job_id, series in points.items() for (step, name), value in series.items()
        ])
    engine.dispose()

    # To 0004, not head: what follows reads the tables with today's models, which agree with 0004
    # on metrics and metric_buckets.
    command.upgrade(alembic_config(empty_database_url), "0004")
    query = select(MetricBucket).order_by(MetricBucket.job_id, MetricBucket.name, MetricBucket.level, MetricBucket.bucket)
    with session_factory(empty_database_url)() as session:
        migrated = [{c.key: getattr(row, c.key) for c in MetricBucket.__table__.columns} for row in session.scalars(query)]
        session.execute(delete(MetricBucket))
        for job_id in points:
            refresh_metric_buckets(session, job_id)
        rebuilt = [{c.key: getattr(row, c.key) for c in MetricBucket.__table__.columns} for row in session.scalars(query)]
        session.rollback()
    assert migrated == rebuilt
    assert {(row["level"], row["bucket"]) for row in migrated if row["level"] == 4} == {(4, 0), (4, 1)}
    assert sum(row["count"] for row in migrated if row["level"] == 4) == sum(map(len, points.values()))
