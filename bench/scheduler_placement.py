"""Scheduler placement: how long `schedule_pass` takes to place a backlog of queued jobs on 100 hosts.

    PYTHONPATH=$PWD .venv/bin/python bench/scheduler_placement.py [--sizes 1000x100 10000x1000] [--backends postgres sqlite]

For each backend and size (jobs x hosts): a fresh database, the registered CPU hosts with just enough
slots for every job, and the backlog queued with mixed priorities (one job in four asks for 2
slots). Then `schedule_pass` is called, as the scheduler process would, until every job is
placed; the time of those calls is the figure (the scheduler's pause between passes is not
counted). Doubling the backlog twice, and ten times the jobs on ten times the hosts, show whether
the time grows linearly with the work.

The peer is the database floor for the same placements, on the same data: one transaction that
reads the backlog in priority order and writes what a placement writes (the jobs' status, one
attempt per job, one status event per job) with one bulk statement per table; then rolled back.
Targets: 1,000 jobs on 100 hosts in ≤ 5 s; 10,000 on 1,000 in ≤ 2 s and within 4× the floor.
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

from sqlalchemy import insert, select, text, update  # noqa: E402

from api_schemas import JobEventType, JobStatus  # noqa: E402
from bench.scratch import database  # noqa: E402
from service.db.accounts import create_user  # noqa: E402
from service.db.hosts import all_hosts, register_host  # noqa: E402
from service.db.models import Attempt, Job, JobEvent, utcnow  # noqa: E402
from service.db.session import session_factory  # noqa: E402
from service.scheduler import schedule_pass  # noqa: E402
from common.settings import Settings  # noqa: E402
from tests.helpers import busy_slots_by_host, job_spec  # noqa: E402



def queue_backlog(sessions, jobs: int, hosts: int) -> None:
    """`jobs` queued jobs, as service.db.jobs.create_job would store them, inserted in bulk to keep set-up short."""
    rng = random.Random(0)
    narrow = job_spec().model_dump(mode="json")
    wide = job_spec(**{"resources.processes_per_node": 2}).model_dump(mode="json")
    with sessions() as session:
        owner, _ = create_user(session, "bench")
        rows = []
        for i in range(jobs):
            spec = dict(wide if i % 4 == 0 else narrow, priority=rng.randint(0, 9))
            rows.append({"owner_id": owner.id, "name": spec["name"], "spec": spec, "status": JobStatus.queued,
                         "priority": spec["priority"], "max_steps": spec["training"]["max_steps"], "created_at": utcnow()})
        session.execute(insert(Job), rows)
        # Just enough slots: the backlog needs 1.25 slots per job on average.
        slots = -(-jobs * 5 // 4 // hosts)
        for h in range(hosts):
            register_host(session, f"host-{h:03d}", "cpu", slots, {})
        session.commit()


def time_trainyard(sessions, settings: Settings, jobs: int) -> tuple[float, int]:
    """Seconds spent in schedule_pass until every job is placed, and the number of passes."""
    placed, passes, elapsed = 0, 0, 0.0
    while placed < jobs:
        with sessions() as session:
            start = time.perf_counter()
            placed += len(schedule_pass(session, settings))
            elapsed += time.perf_counter() - start
        passes += 1
        if passes > jobs:
            raise SystemExit(f"placed only {placed} of {jobs} jobs after {passes} passes")
    return elapsed, passes


def time_floor(sessions, hosts: int) -> float:
    """The same placements' reads and writes in one bulk statement per table, then rolled back."""
    with sessions() as session:
        start = time.perf_counter()
        now = utcnow()
        queued = session.execute(
            select(Job.id).where(Job.status == JobStatus.queued).order_by(Job.priority.desc(), Job.id).with_for_update()
        ).scalars().all()
        session.execute(update(Job).where(Job.id.in_(queued)).values(status=JobStatus.scheduled, last_event_seq=Job.last_event_seq + 1))
        session.execute(insert(Attempt), [
            {"job_id": job_id, "number": 1, "node_rank": 0, "host_name": f"host-{i % hosts:03d}", "slots": 1,
             "status": "scheduled", "dispatched_at": now, "created_at": now}
            for i, job_id in enumerate(queued)
        ])
        session.execute(insert(JobEvent), [
            {"job_id": job_id, "seq": 1, "type": JobEventType.status, "data": {"status": "scheduled", "reason": None}, "created_at": now}
            for job_id in queued
        ])
        session.flush()
        elapsed = time.perf_counter() - start
        session.rollback()
    return elapsed


def measure(backend: str, jobs: int, hosts: int) -> dict:
    with database(backend) as url:
        sessions = session_factory(url)
        settings = Settings(database_url=url)
        queue_backlog(sessions, jobs, hosts)
        floor = time_floor(sessions, hosts)
        if backend == "postgres":  # clear what the rolled-back floor left behind
            with sessions.kw["bind"].connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.execute(text("VACUUM ANALYZE"))
        seconds, passes = time_trainyard(sessions, settings, jobs)
        with sessions() as session:
            busy = busy_slots_by_host(session)
            if any(busy.get(h.name, 0) > h.slots for h in all_hosts(session)):
                raise SystemExit("a host was given more than its slots")
    return {"backend": backend, "jobs": jobs, "hosts": hosts, "passes": passes, "trainyard_s": round(seconds, 3),
            "floor_s": round(floor, 3), "ratio": round(seconds / floor, 1), "jobs_per_s": round(jobs / seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["1000x100", "2000x100", "4000x100", "10000x1000"], help="JOBSxHOSTS")
    parser.add_argument("--backends", nargs="+", choices=["postgres", "sqlite"], default=["postgres", "sqlite"])
    args = parser.parse_args()

    sizes = [tuple(map(int, size.split("x"))) for size in args.sizes]
    runs = [measure(backend, jobs, hosts) for backend in args.backends for jobs, hosts in sizes]
    print(json.dumps({
        "benchmark": "scheduler_placement",
        "machine": f"{os.cpu_count()} CPU cores",
        "targets": {"1000x100": "<= 5 s", "10000x1000": "<= 2 s and <= 4x the floor"},
        "runs": runs,
    }))


if __name__ == "__main__":
    main()
