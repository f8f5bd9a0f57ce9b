"""Metric ingest: points/s into PostgreSQL through record_metrics, against a bulk COPY of the same rows.

    PYTHONPATH=$PWD .venv/bin/python bench/metric_ingest.py [--batches 40] [--steps-per-batch 300]

A worker flushes what its job reported every heartbeat (5 s). A fast job does ~60 steps/s with 7
metrics per step, so one flush is ~300 steps × 7 = 2,100 points: that is one batch here. Trainyard
stores each batch with record_metrics, as the supervisor does (upsert of the points, the
job's step, one metrics event per step in the job's event log, one commit). The peer writes the
same rows for another job with psycopg's COPY, one commit per batch: the fastest way into that
table. Batches alternate between the two. Targets: ratio ≥ 0.5 and ≥ 50,000 points/s.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psycopg  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from bench.scratch import postgres_database  # noqa: E402
from service.db.accounts import create_user  # noqa: E402
from service.db.attempts import ClaimedAttempt, claim_attempt  # noqa: E402
from service.db.hosts import register_host  # noqa: E402
from service.db.jobs import create_job  # noqa: E402
from service.db.metrics import record_metrics  # noqa: E402
from service.db.models import Metric  # noqa: E402
from service.db.session import session_factory  # noqa: E402
from service.scheduler import schedule_pass  # noqa: E402
from common.settings import Settings  # noqa: E402
from tests.helpers import job_spec  # noqa: E402

NAMES = ["train_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "peak_memory_mb", "eval_loss"]


def running_job(sessions, settings: Settings, owner) -> ClaimedAttempt:
    """A job placed and claimed as a worker would, so record_metrics sees a real running attempt."""
    with sessions() as session:
        create_job(session, owner, job_spec())
        [(attempt_id, _)] = schedule_pass(session, settings)
        return claim_attempt(session, attempt_id, "bench-worker", settings.lease_seconds)


def batches(count: int, steps_per_batch: int) -> list[list[tuple[int, str, float]]]:
    rng = random.Random(0)
    return [
        [(step, name, rng.random()) for step in range(b * steps_per_batch + 1, (b + 1) * steps_per_batch + 1) for name in NAMES]
        for b in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--steps-per-batch", type=int, default=300)
    args = parser.parse_args()

    work = batches(args.batches, args.steps_per_batch)
    trainyard_s = peer_s = 0.0
    with postgres_database() as url:
        sessions = session_factory(url)
        settings = Settings(database_url=url)
        with sessions() as session:
            owner, _ = create_user(session, "bench")
            register_host(session, "bench-host", "cpu", 2, {})
        ours, theirs = running_job(sessions, settings, owner), running_job(sessions, settings, owner)
        with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as peer:
            for i, points in enumerate(work):
                start = time.perf_counter()
                with sessions() as session:
                    record_metrics(session, ours.job_id, ours.attempt_id, points)
                if i:  # the first batch of each side warms up connections and statement caches
                    trainyard_s += time.perf_counter() - start

                start = time.perf_counter()
                with peer.cursor() as cursor, cursor.copy("COPY metrics (job_id, attempt_id, step, name, value) FROM STDIN") as copy:
                    for step, name, value in points:
                        copy.write_row((theirs.job_id, theirs.attempt_id, step, name, value))
                peer.commit()
                if i:
                    peer_s += time.perf_counter() - start
        with sessions() as session:  # every point of both sides stored (COPY keeps no summaries: count rows)
            stored = session.scalar(select(func.count()).select_from(Metric))
            assert stored == 2 * len(work) * len(work[0]), stored

    points = (len(work) - 1) * len(work[0])
    print(json.dumps({
        "benchmark": "metric_ingest",
        "machine": f"{os.cpu_count()} CPU cores",
        "batch_points": len(work[0]),
        "batches": len(work) - 1,
        "peer_copy_points_per_s": round(points / peer_s),
        "trainyard_points_per_s": round(points / trainyard_s),
        "ratio": round(peer_s / trainyard_s, 3),
    }))


if __name__ == "__main__":
    main()
