"""Dispatch latency: from a job queued to its attempt running on a worker, against a bare Celery round trip.

    PYTHONPATH=$PWD .venv/bin/python bench/dispatch_latency.py [--jobs 20] [--broker redis|sqlite]

Trainyard's side is the real path on an empty cluster: the job is queued with create_job, the
scheduler process (`trainyard scheduler`, default settings) places it and sends the Celery task,
and a worker process (`trainyard worker`, one CPU slot) claims the attempt. Latency = the attempt's
started_at (stamped by the worker once the claim has read the attempt, before its writes commit:
~2 ms before anyone else sees it running, which flatters Trainyard) minus the moment the job was queued: when the
transaction that queues it has committed (the job exists for nobody before; its created_at is
written at the INSERT, a few milliseconds earlier, and is reported as "commit"). The job is cancelled as soon as it runs, so its training never competes with the next
job for the CPU; the next job is queued once the last one has ended.

The peer is a no-op Celery task on the same broker and worker settings (thread pool, prefetch 1,
late acks): send, run on a worker process, result back to the sender. It is a round trip while
Trainyard's figure is one way, which flatters the peer's side of the ratio only by the return leg.
Rounds alternate peer and job. Target: Trainyard median ≤ 1.5× the peer's.

--broker redis (default, production): PostgreSQL + Redis database 12. --broker sqlite (embedded):
SQLite + the SQLAlchemy transport on SQLite, as `trainyard up` runs. Prints one JSON line; the
split of Trainyard's time into "scheduler" (queued → placed) and "dispatch" (placed → claimed)
says where it goes: "scheduler" ends when the pass inserts the attempt (before the pass commits).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api_schemas import JobSpec  # noqa: E402
from bench.scratch import REDIS_URL, postgres_database, sqlite_database  # noqa: E402
from service.db.accounts import create_user, user_by_name  # noqa: E402
from service.db.jobs import create_job, job_status, request_cancel  # noqa: E402
from service.db.models import Attempt, Job, utcnow  # noqa: E402
from service.db.session import session_factory  # noqa: E402
from stack.embedded import stop_children  # noqa: E402
from common.queue import make_celery  # noqa: E402
from common.settings import Settings  # noqa: E402
from tests.helpers import job_spec  # noqa: E402

PEER_TASK, PEER_QUEUE = "bench.noop", "bench.noop"
HOST = "bench-host"


def peer_celery(broker_url: str, backend_url: str):
    """Trainyard's own Celery configuration, plus a result backend so the sender sees the task end."""
    app = make_celery(Settings(broker_url=broker_url))
    app.conf.update(result_backend=backend_url, task_ignore_result=False)
    return app


def serve_peer(broker_url: str, backend_url: str) -> None:
    """The peer's worker process: one thread, the no-op task, the same flags as `workers.host.run_worker`."""
    app = peer_celery(broker_url, backend_url)

    @app.task(name=PEER_TASK)
    def noop() -> None:
        pass

    app.worker_main(["worker", "--queues", PEER_QUEUE, "--pool", "threads", "--concurrency", "1", "--prefetch-multiplier", "1",
                     "--hostname", "bench-peer@trainyard", "--without-gossip", "--without-mingle", "--loglevel", "WARNING"])


def peer_round_trip(app) -> float:
    start = time.perf_counter()
    app.send_task(PEER_TASK, queue=PEER_QUEUE).get(timeout=30, interval=0.01)
    return time.perf_counter() - start


def job_latency(sessions, owner_name: str, spec: JobSpec) -> tuple[float, float, float]:
    """Queue one job, wait until a worker runs it, cancel it and wait for the end.
    Returns (total, commit, scheduler, dispatch) seconds: total is queued (committed) → claimed;
    commit (the INSERT → commit of the queuing transaction) is not part of it."""
    with sessions() as session:
        job = create_job(session, user_by_name(session, owner_name), spec)
    queued_at = utcnow()  # committed: from here on the scheduler can see the job
    deadline = time.monotonic() + 60
    while True:
        with sessions() as session:
            attempt = session.query(Attempt).filter(Attempt.job_id == job.id, Attempt.started_at.is_not(None)).one_or_none()
            if attempt is not None:
                request_cancel(session, session.get(Job, job.id))
                break
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job.id} did not start within 60 s; see the worker and scheduler logs")
        time.sleep(0.02)
    while True:
        with sessions() as session:
            if job_status(session, job.id).is_final:
                break
        time.sleep(0.05)
    return (
        (attempt.started_at - queued_at).total_seconds(),
        (queued_at - job.created_at).total_seconds(),
        (attempt.created_at - queued_at).total_seconds(),
        (attempt.started_at - attempt.created_at).total_seconds(),
    )


@contextlib.contextmanager
def backends(broker: str, tmp: Path):
    """(database URL, broker URL, result backend URL) for the production or the embedded setup."""
    if broker == "sqlite":
        with sqlite_database() as database_url:
            yield database_url, f"sqla+sqlite:///{tmp}/broker.db", f"db+sqlite:///{tmp}/results.db"
        return
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    try:
        with postgres_database() as database_url:
            yield database_url, REDIS_URL, REDIS_URL
    finally:
        client.flushdb()


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20, help="measured rounds (after 2 warm-up rounds)")
    parser.add_argument("--broker", choices=["redis", "sqlite"], default="redis")
    parser.add_argument("--serve-peer", nargs=2, metavar=("BROKER_URL", "BACKEND_URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_peer:
        return serve_peer(*args.serve_peer)

    spec = job_spec(max_restarts=0)
    with tempfile.TemporaryDirectory() as tmp_name, backends(args.broker, Path(tmp_name)) as (database_url, broker_url, backend_url):
        tmp = Path(tmp_name)
        sessions = session_factory(database_url)
        with sessions() as session:
            create_user(session, "bench")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "TRAINYARD_DATA_DIR": str(tmp),
            "TRAINYARD_DATABASE_URL": database_url,
            "TRAINYARD_BROKER_URL": broker_url,
            # Only how soon the worker notices the cancel, after the measured part.
            "TRAINYARD_HEARTBEAT_SECONDS": "0.5",
        }
        commands = {
            "scheduler": [sys.executable, "-m", "trainyard", "scheduler"],
            "worker": [sys.executable, "-m", "trainyard", "worker", "--host-name", HOST, "--devices", "cpu:1", "--address", "127.0.0.1"],
            "peer": [sys.executable, __file__, "--serve-peer", broker_url, backend_url],
        }
        children = [subprocess.Popen(command, env=env, stdout=open(tmp / f"{name}.log", "wb"), stderr=subprocess.STDOUT)
                    for name, command in commands.items()]
        try:
            peer_app = peer_celery(broker_url, backend_url)
            peer, total, commit, scheduler, dispatch = [], [], [], [], []
            for round_ in range(args.jobs + 2):
                peer_s = peer_round_trip(peer_app)
                job_s = job_latency(sessions, "bench", spec)
                if round_ >= 2:  # warm-up: connections, first imports, queue declarations
                    peer.append(peer_s)
                    for figures, value in zip((total, commit, scheduler, dispatch), job_s):
                        figures.append(value)
        except BaseException:
            for name in commands:
                sys.stderr.write(f"--- {name}.log\n" + (tmp / f"{name}.log").read_text(errors="replace")[-3000:])
            raise
        finally:
            stop_children(children)

    ms = lambda seconds: round(seconds * 1000, 1)  # noqa: E731
    result = {
        "benchmark": "dispatch_latency",
        "machine": f"{os.cpu_count()} CPU cores",
        "broker": args.broker,
        "jobs": args.jobs,
        "peer_round_trip_ms": {"median": ms(statistics.median(peer)), "p90": ms(p90(peer))},
        "trainyard_queued_to_running_ms": {"median": ms(statistics.median(total)), "p90": ms(p90(total))},
        "trainyard_split_median_ms": {"scheduler": ms(statistics.median(scheduler)), "dispatch": ms(statistics.median(dispatch))},
        "queuing_commit_median_ms": ms(statistics.median(commit)),
        "ratio": round(statistics.median(total) / statistics.median(peer), 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
