"""Metrics query latency: GET /v1/jobs/{id}/metrics?max_points=1000 on a job of 1M points (PostgreSQL).

    PYTHONPATH=$PWD .venv/bin/python bench/metrics_query.py [--points 1000000] [--other-jobs 10000] [--requests 5]

One job holds `--points` points over 7 series (the metrics a training job reports each step),
beside `--other-jobs` other jobs of 100 points each, so the table is not that job's alone. The
rows are generated inside PostgreSQL to keep set-up short. The request goes through the real
API app (FastAPI's TestClient, in-process: no socket, but routing, auth, the query, downsampling
and JSON encoding). The endpoint reads the job's bucket summaries (service/db/rollups.py), which
record_metrics keeps at ingest; here they are built once after the bulk fill. The peer is what the
endpoint used to pay before them, the floor of any design that reads every point: psycopg fetching
that job's points in the order the endpoint read them. Requests
alternate between the two. Target: p99 ≤ 100 ms. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psycopg  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from bench.scratch import postgres_database  # noqa: E402
from service.api.main import create_app  # noqa: E402
from service.db.accounts import create_user  # noqa: E402
from service.db.metric_buckets import refresh_metric_buckets  # noqa: E402
from service.db.session import session_factory  # noqa: E402
from common.settings import Settings  # noqa: E402
from tests.helpers import job_spec  # noqa: E402

NAMES = ["train_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "peak_memory_mb", "eval_loss"]


def fill(connection: psycopg.Connection, owner_id: int, spec: dict, points: int, other_jobs: int) -> int:
    """Insert the other jobs and their points, then the big job and its; returns the big job's id."""
    steps = points // len(NAMES)
    job_columns = "owner_id, name, spec, status, priority, max_steps, step, restarts, cancel_requested, created_at, last_event_seq"
    job_values = "%(owner)s, 'bench', %(spec)s, 'succeeded', 0, %(steps)s, %(steps)s, 0, false, now(), 0"
    params = {"owner": owner_id, "spec": json.dumps(spec), "names": NAMES, "others": other_jobs, "steps": steps}
    connection.execute(f"INSERT INTO jobs ({job_columns}) SELECT {job_values} FROM generate_series(1, %(others)s)", params)
    # Random values: every bucket has its own minimum and maximum for the downsampling to find.
    series = """
        INSERT INTO metrics (job_id, name, step, value, attempt_id)
        SELECT job.id, metric.name, point.step, 1 + random(), 0
        FROM jobs AS job, unnest(%(names)s::varchar[]) AS metric(name), generate_series(1, {steps}) AS point(step)
        WHERE {which}
    """
    connection.execute(series.format(steps=100 // len(NAMES), which="job.id IS NOT NULL"), params)
    job_id = connection.execute(f"INSERT INTO jobs ({job_columns}) VALUES ({job_values}) RETURNING id", params).fetchone()[0]
    connection.execute(series.format(steps="%(steps)s", which="job.id = %(job)s"), {**params, "job": job_id})
    connection.commit()
    connection.execute("ANALYZE")
    return job_id


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--other-jobs", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=20, help="measured requests of each; p99 of so few is their maximum")
    args = parser.parse_args()

    with postgres_database() as url, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=url)
        with session_factory(url)() as session:
            owner, token = create_user(session, "bench")
        with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as peer:
            start = time.perf_counter()
            job_id = fill(peer, owner.id, job_spec().model_dump(mode="json"), args.points, args.other_jobs)
            fill_s = time.perf_counter() - start
            rows_in_table = peer.execute("SELECT count(*) FROM metrics").fetchone()[0]
            # The rows went in behind the ingest path's back: build the job's bucket summaries as
            # record_metrics keeps them (the other jobs' are left out: the query reads its own job's
            # rows by primary key, which other jobs' rows don't slow).
            start = time.perf_counter()
            with session_factory(url)() as session:
                refresh_metric_buckets(session, job_id)
                session.commit()
            buckets_s = time.perf_counter() - start

            api = TestClient(create_app(settings), headers={"Authorization": f"Bearer {token}"})
            trainyard_ms, peer_ms = [], []
            for round_ in range(args.requests + 1):
                start = time.perf_counter()
                response = api.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 1000})
                elapsed = time.perf_counter() - start
                response.raise_for_status()
                returned = sum(len(s["steps"]) for s in response.json()["series"].values())

                start = time.perf_counter()
                read = peer.execute("SELECT name, step, value FROM metrics WHERE job_id = %s ORDER BY name, step", (job_id,)).fetchall()
                peer.commit()
                peer_elapsed = time.perf_counter() - start
                if round_:  # the first of each warms up connections and caches
                    trainyard_ms.append(elapsed * 1000)
                    peer_ms.append(peer_elapsed * 1000)

    print(json.dumps({
        "benchmark": "metrics_query",
        "machine": f"{os.cpu_count()} CPU cores",
        "job_points": len(read),
        "metrics_rows_in_table": rows_in_table,
        "jobs_in_table": args.other_jobs + 1,
        "points_returned": returned,
        "setup_s": round(fill_s, 1),
        "buckets_built_s": round(buckets_s, 1),
        "requests": args.requests,
        "trainyard_ms": {"p50": round(statistics.median(trainyard_ms)), "p99": round(percentile(trainyard_ms, 0.99))},
        "peer_db_read_ms": {"p50": round(statistics.median(peer_ms)), "p99": round(percentile(peer_ms, 0.99))},
        "target_p99_ms": 100,
        "ratio": round(statistics.median(trainyard_ms) / statistics.median(peer_ms), 2),
    }))


if __name__ == "__main__":
    main()
