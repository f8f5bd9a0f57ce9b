"""Hostile neighbours: what one user's floods cost another user, on PostgreSQL + Redis.

    PYTHONPATH=$PWD .venv/bin/python bench/hostile.py [--lines 100000] [--points 1000000] [--submits 30]

One stack (API, scheduler, two worker hosts of one core each) on a fresh PostgreSQL database and
Redis database 12 (bench/scratch.py). Bob's job trains on one host in both rounds, and bob lists
his jobs (GET /v1/jobs) every 50 ms:
  - quiet (the peer): nobody else does anything;
  - hostile: on the other host alice's script prints --lines lines and writes --points metric
    points at once, and alice sends --submits submits with one Idempotency-Key at once.
Meanwhile every running attempt's lease is watched in the database every 0.25 s.

Prints one JSON line per round and a summary: alice's lines (and how many twice) and points stored (of those sent),
jobs her same-key submits made, 5xx answers, attempts lost, the worst gap between two renewals of
any lease, bob's p50/p99, and hostile p99 / quiet p99. Targets: 0 lost attempts, 0 × 5xx, renewal
gap ≤ ⅓ of the lease, bob's p99 ≤ 250 ms, every line and point stored once.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import tarfile
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.scratch import REDIS_URL, postgres_database  # noqa: E402
from service.db.models import Attempt, LogLine, Metric  # noqa: E402
from service.db.session import read_session_factory  # noqa: E402
from stack.embedded import embedded_stack  # noqa: E402
from common.settings import Settings  # noqa: E402
from workers.supervisor import free_port  # noqa: E402

FLOOD = '''
import json, os, sys
lines, points = int(sys.argv[1]), int(sys.argv[2])
for i in range(lines):
    print(f"line {i} " + "x" * 60)
with open(os.environ["TRAINYARD_EVENTS_FILE"], "a") as events:
    for step in range(points // 10):
        events.write(json.dumps({"type": "metrics", "step": step, "values": {f"m{k}": step + k for k in range(10)}}) + "\\n")
print("done")
'''


def bob_spec() -> dict:
    spec = json.loads((REPO / "examples" / "shakespeare-char.json").read_text())
    spec["training"].update(max_steps=1_000_000, eval_every=1000)
    spec["checkpoint"] = {"every_steps": None, "keep_last": 1}
    return spec


class LeaseWatch(threading.Thread):
    """The longest time any running attempt went without its lease being renewed, read from the database."""

    def __init__(self, database_url: str):
        super().__init__(daemon=True)
        self.sessions, self.stop, self.worst = read_session_factory(database_url), threading.Event(), 0.0

    def run(self) -> None:
        seen: dict[int, tuple[object, float]] = {}  # attempt id -> (lease expiry, when it last changed)
        while not self.stop.wait(0.25):
            with self.sessions() as session:
                rows = session.execute(select(Attempt.id, Attempt.lease_expires_at).where(Attempt.status == "running")).all()
            now = time.monotonic()
            for attempt_id, expires in rows:
                before = seen.get(attempt_id)
                if before is None or before[0] != expires:
                    seen[attempt_id] = (expires, now)
                self.worst = max(self.worst, now - seen[attempt_id][1])


def bundle(script: str) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        data = script.encode()
        info = tarfile.TarInfo("flood.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def wait_final(client: httpx.Client, job_id: int, timeout: float = 900) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} not done after {timeout} s")


async def same_key_submits(url: str, token: str, count: int, spec: dict) -> list[int]:
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": f"flood-{time.time_ns()}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=httpx.Limits(max_connections=count)) as client:
        answers = await asyncio.gather(*(client.post("/v1/jobs", json=spec) for _ in range(count)))
    return [answer.status_code for answer in answers] + [answer.json().get("id", -1) for answer in answers if answer.status_code < 300]


def run_round(hostile: bool, args, url: str, tokens: dict[str, str], database_url: str) -> dict:
    alice = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tokens['alice']}"}, timeout=120)
    bob = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tokens['bob']}"}, timeout=120)
    bob_job = bob.post("/v1/jobs", json=bob_spec()).json()["id"]
    while bob.get(f"/v1/jobs/{bob_job}").json()["step"] < 5:  # training
        time.sleep(0.2)
    watch = LeaseWatch(database_url)
    watch.start()
    latencies, statuses, stop = [], [], threading.Event()

    def list_jobs() -> None:
        while not stop.is_set():
            started = time.monotonic()
            statuses.append(bob.get("/v1/jobs").status_code)
            latencies.append(time.monotonic() - started)
            stop.wait(0.05)

    lister = threading.Thread(target=list_jobs, daemon=True)
    lister.start()
    result: dict = {"round": "hostile" if hostile else "quiet"}
    if hostile:
        code = alice.post("/v1/code", params={"name": "flood.tgz"}, content=bundle(textwrap.dedent(FLOOD)),
                          headers={"Content-Type": "application/octet-stream"}).json()["id"]
        spec = {"name": "flood", "script": {"entrypoint": "flood.py", "args": [str(args.lines), str(args.points)],
                                            "code": {"upload_id": code}}, "max_restarts": 0}
        flood = alice.post("/v1/jobs", json=spec).json()["id"]
        answers = asyncio.run(same_key_submits(url, tokens["alice"], args.submits, {**spec, "name": "same-key"}))
        codes, ids = answers[: args.submits], answers[args.submits:]
        flooded = wait_final(alice, flood)
        with read_session_factory(database_url)() as session:
            # The script's own lines (each distinct: "line i …", then "done") apart from those the worker adds (its notes).
            script_line = LogLine.line.like("line %") | (LogLine.line == "done")
            of_flood = select(LogLine.line).where(LogLine.job_id == flood, script_line).subquery()
            lines, distinct_lines = session.execute(
                select(func.count(), func.count(func.distinct(of_flood.c.line))).select_from(of_flood)
            ).one()
            worker_lines = session.scalars(select(LogLine.line).where(LogLine.job_id == flood, ~script_line)).all()
            points = session.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == flood, Metric.name.like("m%")))
        for job_id in set(ids):
            alice.post(f"/v1/jobs/{job_id}/cancel")
        result.update(flood_status=flooded["status"], lines_stored=lines, lines_sent=args.lines + 1, lines_stored_twice=lines - distinct_lines,
                      worker_lines=[line[:120] for line in worker_lines], points_stored=points,
                      points_sent=args.points // 10 * 10, same_key_jobs=len(set(ids)), same_key_5xx=sum(c >= 500 for c in codes))
    else:
        time.sleep(args.quiet_seconds)
    stop.set()
    lister.join()
    watch.stop.set()
    watch.join()
    bob.post(f"/v1/jobs/{bob_job}/cancel")
    wait_final(bob, bob_job)
    with read_session_factory(database_url)() as session:
        lost = session.scalar(select(func.count()).select_from(Attempt).where(Attempt.status == "lost"))
    result.update(
        attempts_lost=lost, lease_gap_worst_s=round(watch.worst, 2), bob_5xx=sum(s >= 500 for s in statuses),
        bob_requests=len(latencies), bob_p50_ms=round(statistics.median(latencies) * 1000, 1),
        bob_p99_ms=round(statistics.quantiles(latencies, n=100)[-1] * 1000, 1),
    )
    alice.close()
    bob.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--submits", type=int, default=30)
    parser.add_argument("--quiet-seconds", type=float, default=30.0, help="how long the quiet round watches bob")
    args = parser.parse_args()

    import redis

    from service.db.accounts import create_user
    from service.db.session import session_factory

    redis.Redis.from_url(REDIS_URL).flushdb()
    with postgres_database() as database_url, tempfile.TemporaryDirectory() as tmp:
        with session_factory(database_url)() as session:
            tokens = {name: create_user(session, name, can_run_code=True)[1] for name in ("alice", "bob")}
        with embedded_stack(Path(tmp) / "yard", free_port(), workers=2, devices="cpu:1", database_url=database_url, broker_url=REDIS_URL) as info:
            lease = Settings().lease_seconds
            quiet = run_round(False, args, info.url, tokens, database_url)
            print(json.dumps(quiet), flush=True)
            hostile = run_round(True, args, info.url, tokens, database_url)
            print(json.dumps(hostile), flush=True)
    redis.Redis.from_url(REDIS_URL).flushdb()
    summary = {
        "bob_p99_ratio_hostile_over_quiet": round(hostile["bob_p99_ms"] / max(quiet["bob_p99_ms"], 0.1), 2),
        "lease_gap_worst_over_lease": round(hostile["lease_gap_worst_s"] / lease, 3),
        "targets_met": hostile["attempts_lost"] == 0 and hostile["same_key_5xx"] == 0 and hostile["bob_5xx"] == 0
        and hostile["lease_gap_worst_s"] <= lease / 3 and hostile["bob_p99_ms"] <= 250
        and hostile["lines_stored"] == hostile["lines_sent"] and hostile["lines_stored_twice"] == 0
        and hostile["points_stored"] == hostile["points_sent"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
