"""Many worker hosts speaking the worker protocol to two API processes on PostgreSQL, against the
old design (each host its own database connection) at the size where that still fits.

    make .venv/.bench-stamp  # aiohttp, for the simulated hosts
    PYTHONPATH=$PWD .venv/bin/python bench/agents.py [--hosts 1000] [--seconds 30] [--warmup 20]
    PYTHONPATH=$PWD .venv/bin/python bench/agents.py --serial 1000        # the API's and PostgreSQL's CPU per request, one at a time
    PYTHONPATH=$PWD .venv/bin/python bench/agents.py --instructions 100 [--peer-tree DIR]  # its instructions (valgrind)

Simulated hosts (asyncio, no training) speak the real protocol (api_schemas/host_api.py) as a
worker does (workers/host_client.py, workers/supervisor.py): each registers; half of them have
claimed an attempt, make a step of 7 metrics 5 times a second, forward what is new every 0.25 s, or
less often when the API answers slowly (forward_pause) or asks for fewer reports (Reported), and
renew their lease every 5 s, which is their heartbeat too (in that heartbeat's report, or alone when
there is nothing to report, as a worker's sync does); the other half heartbeat as the
service's terms say (every 10 s: a third of the 30 s host timeout; the old design's every 5 s). A
user meanwhile asks for
/healthz and GET /v1/jobs twice a second. Measured: PostgreSQL connections in use (pg_stat_activity,
sampled every second), lease renewals later than a third of the lease after the one before
(late), report (ingest) latency p50/p99, the user's p99s, and the API processes' CPU and RSS.

The peer is the old design: the same per-host load, written straight into PostgreSQL through the
data layer by threads that each hold their own connection, as each host's worker did, at 90 hosts
(PostgreSQL's default 100 connections: past about 75-90 hosts it does not fit at all). Trainyard
runs that same 90-host load too, so the two are compared at equal load, then at --hosts. Prints one
JSON line. Needs the local PostgreSQL (127.0.0.1:5432, trust auth): it makes a database of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import aiohttp
import httpx
import psutil
from sqlalchemy import create_engine, text

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api_schemas.host_api import HOST_API_PREFIX  # noqa: E402
from stack.embedded import stop_children, wait_healthy  # noqa: E402
from workers.supervisor import forward_pause, free_port, heartbeat_pause  # noqa: E402

ADMIN_URL = os.environ.get("BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
METRICS = ["train_loss", "lr", "grad_norm", "tokens_per_s", "cpu_percent", "rss_gb", "step_time_s"]
STEP_SECONDS, HEARTBEAT_SECONDS, LEASE_SECONDS = 0.2, 5.0, 30.0
LATE_GAP = LEASE_SECONDS / 3


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)  # ms


# -- the database and its seed ------------------------------------------------------------------


def fresh_database() -> str:
    name = f"bench_agents_{uuid.uuid4().hex[:8]}"
    engine = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return ADMIN_URL.rsplit("/", 1)[0] + "/" + name


def drop_database(url: str) -> None:
    engine = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)'))
    engine.dispose()


def seed(url: str, hosts: int, prefix: str) -> tuple[dict[str, str], dict[str, int]]:
    """`hosts` registered hosts of one slot with their tokens, and a running job placed on half of
    them: ({host: token}, {host: attempt id})."""
    from api_schemas import JobSpec
    from service.db.accounts import create_user
    from service.db.host_tokens import issue_host_token
    from service.db.hosts import register_host
    from service.db.jobs import create_job
    from service.db.session import session_factory
    from service.scheduler import schedule_pass
    from common.settings import Settings
    from tests.helpers import tiny_spec

    sessions = session_factory(url)
    names = [f"{prefix}{i:04d}" for i in range(hosts)]
    with sessions() as session:
        tokens = {name: issue_host_token(session, name) for name in names}
        for name in names:
            register_host(session, name, "cpu", 1, {"sandbox": "bench"})
        spec = JobSpec.model_validate(tiny_spec(**{"training.max_steps": 10**6}))
        for user in range((hosts // 2 + 49) // 50):  # each user within the default quota of active jobs
            owner = create_user(session, f"{prefix}user{user}")[0]
            for _ in range(min(50, hosts // 2 - user * 50)):
                create_job(session, owner, spec)
        placed = schedule_pass(session, Settings(database_url=url, host_timeout_seconds=600))
    return tokens, {host: attempt_id for attempt_id, host in placed}


# -- Trainyard: simulated hosts over HTTP -------------------------------------------------------


async def simulated_host(client: aiohttp.ClientSession, name: str, token: str, attempt_id: int | None, stop_at: float, stats: dict) -> None:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    answers = {}

    async def post(path: str, body: dict | None = None) -> float | None:
        """Seconds the request took; None if it failed (the worker keeps what it sent, for its next round)."""
        start = time.monotonic()
        try:
            async with client.post(HOST_API_PREFIX + path, data=json.dumps(body) if body else None, headers=headers) as answer:
                answers[path] = await answer.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            stats["errors"].append(f"{path.split('/')[-1]} {type(exc).__name__}")
            return None
        if answer.status >= 300:
            stats["errors"].append(f"{path.split('/')[-1]} {answer.status}")
            return None
        stats["requests"] += 1
        return time.monotonic() - start

    await asyncio.sleep(random.uniform(0, HEARTBEAT_SECONDS))  # hosts start at different times
    await post("/register", {"device": "cpu", "slots": 1, "address": "127.0.0.1", "info": {"sandbox": "bench"}})
    # Idle, it heartbeats as often as the service's terms say (a third of the host timeout), as a worker does.
    idle_heartbeat = json.loads(answers.get("/register") or "{}").get("idle_heartbeat_seconds") or HEARTBEAT_SECONDS
    owner = f"{name}:sim"
    if attempt_id is not None:
        await post(f"/attempts/{attempt_id}/claim", {"lease_owner": owner, "rendezvous": "127.0.0.1:1"})
    now = time.monotonic()
    step, pending, renewed_at, paced = 0, [], now, False
    # Renewals and heartbeats as a worker times them: an attempt's first renewal anywhere within the period.
    next_step, next_report = now, now
    next_renew, next_heartbeat = now + heartbeat_pause(HEARTBEAT_SECONDS, first=True), now + idle_heartbeat
    while (now := time.monotonic()) < stop_at:
        if attempt_id is not None:
            while next_step <= now:
                step += 1
                pending += [[step, metric, random.random()] for metric in METRICS]
                next_step += STEP_SECONDS
            # The heartbeat is due: renewed with the report if one is due too (as a worker's sync), else
            # alone. Paced to a heartbeat or more, reports go with the heartbeats only.
            renew = now >= next_renew
            renewed = False
            if pending and now >= next_report and (renew or not paced):
                started = time.monotonic()
                path = f"/attempts/{attempt_id}/report"
                took = await post(path, {"lease_owner": owner, "metrics": pending, "renew_lease": renew})
                if took is not None:  # else kept, and sent again with what comes next
                    stats["ingest"].append(took)
                    stats["report_times"].append(int(started))
                    stats["points"] += len(pending)
                    pending, renewed = [], renew
                asked = json.loads(answers[path])["next_report_seconds"] if took is not None else 0.0
                pause = max(asked, forward_pause(time.monotonic() - started))
                next_report, paced = started + pause, pause >= HEARTBEAT_SECONDS
            elif renew:
                renewed = await post(f"/attempts/{attempt_id}/lease", {"lease_owner": owner}) is not None
            if renewed:
                done = time.monotonic()
                stats["renewal_gaps"].append(done - renewed_at)
                renewed_at = done
            if renew:
                next_renew += heartbeat_pause(HEARTBEAT_SECONDS)
        if attempt_id is None and now >= next_heartbeat:  # a host renewing a lease sends none: the renewal is its heartbeat
            await post("/heartbeat")
            next_heartbeat += heartbeat_pause(idle_heartbeat)
        upcoming = [next_step, next_renew] if attempt_id is not None else [next_heartbeat]
        await asyncio.sleep(max(0.0, min(*upcoming, stop_at) - time.monotonic()))


def run_simulated_hosts(urls: list[str], hosts: list[tuple[str, str, int | None]], warmup: float, seconds: float, out) -> None:
    """One process's share of the hosts, spread over the API processes; its stats of the `seconds`
    after the `warmup` (registrations, claims, the first reports before the API paces them) sent to `out`."""
    async def main() -> dict:
        stats = {"ingest": [], "renewal_gaps": [], "points": 0, "errors": [], "requests": 0, "report_times": [], "loop_lag": []}
        # aiohttp, not the worker's httpx: a load generator on the machine it measures must cost little
        # (1,000 hosts through httpx's async client took more CPU than the two API processes).
        clients = [
            aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=256), timeout=aiohttp.ClientTimeout(total=60))
            for url in urls
        ]
        stop_at = time.monotonic() + warmup + seconds

        async def forget_the_warmup() -> None:
            await asyncio.sleep(warmup)
            stats.update(ingest=[], renewal_gaps=[], points=0, errors=[], requests=0, report_times=[], loop_lag=[])  # a renewal's gap still counts from the one before

        async def measure_loop_lag() -> None:
            """How late this process's event loop wakes a task: what the hosts' measured latencies owe to the load generator itself."""
            while time.monotonic() < stop_at:
                asleep = time.monotonic()
                await asyncio.sleep(0.01)
                stats["loop_lag"].append(time.monotonic() - asleep - 0.01)

        await asyncio.gather(measure_loop_lag(), forget_the_warmup(), *(
            simulated_host(clients[i % len(clients)], name, token, attempt, stop_at, stats) for i, (name, token, attempt) in enumerate(hosts)
        ), return_exceptions=False)
        for client in clients:
            await client.close()
        return stats

    out.send(asyncio.run(main()))


# -- the peer: each host its own database connection (the old design) --------------------------


def run_direct_hosts(url: str, hosts: list[tuple[str, str, int | None]], seconds: float) -> dict:
    """The old design's per-host load: a thread per host, each with a connection of its own."""
    from service.db.attempts import HeldAttempt, claim_attempt, renew_lease
    from service.db.hosts import record_heartbeat
    from service.db.metrics import record_metrics
    from sqlalchemy.orm import sessionmaker

    stats = {"ingest": [], "renewal_gaps": [], "points": 0, "errors": [], "requests": 0, "report_times": [], "loop_lag": []}
    stop_at = time.monotonic() + seconds

    def host(name: str, attempt_id: int | None) -> None:
        engine = create_engine(url, pool_size=1, max_overflow=0)  # as each host's worker held its own
        sessions = sessionmaker(engine)
        time.sleep(random.uniform(0, HEARTBEAT_SECONDS))
        held = None
        if attempt_id is not None:
            with sessions() as session:
                claimed = claim_attempt(session, attempt_id, f"{name}:sim", LEASE_SECONDS, "127.0.0.1:1")
            held = HeldAttempt(attempt_id, claimed.job_id, claimed.number, claimed.lease_owner)
        now = time.monotonic()
        step, pending, renewed_at = 0, [], now
        next_step, next_report = now, now
        next_renew, next_heartbeat = now + heartbeat_pause(HEARTBEAT_SECONDS, first=True), now + heartbeat_pause(HEARTBEAT_SECONDS, first=True)
        while (now := time.monotonic()) < stop_at:
            with sessions() as session:
                if held is not None:
                    while next_step <= now:
                        step += 1
                        pending += [(step, metric, random.random()) for metric in METRICS]
                        next_step += STEP_SECONDS
                    if pending and now >= next_report:
                        start = time.monotonic()
                        record_metrics(session, held.job_id, held.attempt_id, pending)
                        stats["ingest"].append(time.monotonic() - start)
                        stats["report_times"].append(int(start))
                        stats["points"] += len(pending)
                        pending, next_report = [], time.monotonic() + forward_pause(time.monotonic() - start)
                    if now >= next_renew:
                        renew_lease(session, held, LEASE_SECONDS)
                        done = time.monotonic()
                        stats["renewal_gaps"].append(done - renewed_at)
                        renewed_at, next_renew = done, next_renew + heartbeat_pause(HEARTBEAT_SECONDS)
                if now >= next_heartbeat:
                    record_heartbeat(session, name)
                    next_heartbeat += heartbeat_pause(HEARTBEAT_SECONDS)
            upcoming = [next_heartbeat] + ([next_step, next_renew] if held is not None else [])
            time.sleep(max(0.0, min(upcoming) - time.monotonic()))
        engine.dispose()

    threads = [threading.Thread(target=host, args=(name, attempt)) for name, _, attempt in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return stats


# -- one run, watched -----------------------------------------------------------------------------


class Watch:
    """Every second: PostgreSQL's connections to the database; twice a second: a user's /healthz and
    GET /v1/jobs; the API processes' CPU. Runs on a thread until stopped."""

    def __init__(self, url: str, api_url: str | None, user_token: str | None, apis: list[subprocess.Popen]):
        self.url, self.api_url, self.user_token = url, api_url, user_token
        self.apis = [psutil.Process(api.pid) for api in apis]
        self.connections, self.healthz, self.jobs, self.rss = [], [], [], []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def __enter__(self):
        for api in self.apis:
            api.cpu_times()
        self.cpu_start = [sum(api.cpu_times()[:2]) for api in self.apis]
        self.wall_start = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, *_):
        self.stopping.set()
        self.thread.join()
        self.cpu_s = sum(sum(api.cpu_times()[:2]) for api in self.apis) - sum(self.cpu_start)
        self.wall_s = time.monotonic() - self.wall_start

    def run(self) -> None:
        engine = create_engine(self.url, pool_size=1)
        database = self.url.rsplit("/", 1)[1]
        user = httpx.Client(base_url=self.api_url, headers={"Authorization": f"Bearer {self.user_token}"}, timeout=30) if self.api_url else None
        next_count = 0.0
        while not self.stopping.wait(0.5):
            if time.monotonic() >= next_count:
                with engine.connect() as connection:
                    count = connection.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d"), {"d": database}).scalar()
                self.connections.append(count - 1)  # not this watcher's own
                self.rss.append(sum(api.memory_info().rss for api in self.apis))
                next_count = time.monotonic() + 1.0
            if user is not None:
                for path, into in (("/healthz", self.healthz), ("/v1/jobs?limit=20", self.jobs)):
                    start = time.monotonic()
                    user.get(path)
                    into.append(time.monotonic() - start)
        engine.dispose()


def summary(stats: dict, watch: Watch, hosts: int) -> dict:
    return {
        "hosts": hosts,
        "points_per_s": round(stats["points"] / watch.wall_s),
        "postgres_connections_max": max(watch.connections, default=None),
        "late_renewals": sum(1 for gap in stats["renewal_gaps"] if gap > LATE_GAP),
        "renewals": len(stats["renewal_gaps"]),
        "renewal_gap_max_s": round(max(stats["renewal_gaps"], default=0), 2),
        "ingest_p50_ms": percentile(stats["ingest"], 0.5),
        "ingest_p99_ms": percentile(stats["ingest"], 0.99),
        "reports_busiest_second": max(Counter(stats["report_times"]).values(), default=0),
        "hosts_loop_lag_p99_ms": percentile(stats["loop_lag"], 0.99),
        "healthz_p99_ms": percentile(watch.healthz, 0.99),
        "jobs_list_p99_ms": percentile(watch.jobs, 0.99),
        "api_cpu_cores": round(watch.cpu_s / watch.wall_s, 2) if watch.apis else None,
        "api_rss_mb": round(max(watch.rss, default=0) / 2**20) if watch.apis else None,
        "requests_per_s": round(stats["requests"] / watch.wall_s) if watch.apis else None,
        "api_cpu_ms_per_request": round(watch.cpu_s * 1000 / max(1, stats["requests"]), 2) if watch.apis else None,
        "failed_requests": len(stats["errors"]),
        "failures": dict(Counter(stats["errors"]).most_common(5)),
    }


def trainyard_run(hosts: int, seconds: float, processes: int, warmup: float = 0.0) -> dict:
    url = fresh_database()
    apis = []
    try:
        from service.db.accounts import create_user
        from service.db.migrate import upgrade
        from service.db.session import session_factory

        upgrade(url)
        tokens, placed = seed(url, hosts, "h")
        with session_factory(url)() as session:
            _, user_token = create_user(session, "watcher", is_admin=True)
        env = {**os.environ, "TRAINYARD_DATABASE_URL": url, "TRAINYARD_DATA_DIR": str(Path(f"/tmp/{url.rsplit('/', 1)[1]}")),
               "TRAINYARD_LEASE_SECONDS": str(LEASE_SECONDS)}
        ports = [free_port() for _ in range(2)]
        log = open(os.devnull, "wb")
        apis = [subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--port", str(port)], env=env, stdout=log, stderr=log) for port in ports]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for api_url in urls:
            wait_healthy(api_url, apis)
        everyone = [(name, token, placed.get(name)) for name, token in tokens.items()]
        pipes, workers = [], []
        for share in range(processes):
            receive, send = multiprocessing.Pipe(duplex=False)
            worker = multiprocessing.Process(target=run_simulated_hosts, args=(urls, everyone[share::processes], warmup, seconds, send))
            worker.start()
            pipes.append(receive)
            workers.append(worker)
        time.sleep(warmup)
        with Watch(url, urls[0], user_token, apis) as watch:
            results = [pipe.recv() for pipe in pipes]
            for worker in workers:
                worker.join()
        stats = {"ingest": [], "renewal_gaps": [], "points": 0, "errors": [], "requests": 0, "report_times": [], "loop_lag": []}
        for result in results:
            for key in stats:
                stats[key] += result[key]
        return summary(stats, watch, hosts)
    finally:
        stop_children(apis)
        drop_database(url)


def serial_costs(rounds: int) -> dict:
    """The API's own CPU per request, one request at a time (no queue, nothing else on the API): what
    one host costs it, whatever the machine; and PostgreSQL's (all its processes, so run it alone).
    Two hosts, one of them running an attempt; 35 points a report (a heartbeat's worth of 7 metrics
    at 1 step/s)."""
    with serial_api(REPO, []) as (api, kinds):
        process = psutil.Process(api.pid)
        costs, database_costs = {}, {}
        for kind, send in kinds.items():
            for round_ in range(rounds + rounds // 10):
                if round_ == rounds // 10:  # the first tenth warms up
                    cpu, database_cpu = sum(process.cpu_times()[:2]), postgres_cpu_seconds()
                send()
            costs[kind] = round((sum(process.cpu_times()[:2]) - cpu) * 1000 / rounds, 2)
            database_costs[kind] = round((postgres_cpu_seconds() - database_cpu) * 1000 / rounds, 2)
    costs["report_renewing_over_lease_then_report"] = round(costs["running_heartbeat_report_renewing"] / costs["running_heartbeat_lease_then_report"], 2)
    return {"api_cpu_ms": costs, "postgres_cpu_ms": database_costs, "rounds": rounds}


def postgres_cpu_seconds() -> float:
    """CPU time of this machine's PostgreSQL processes (its backends and its own: WAL writer and so on)."""
    total = 0.0
    for server in psutil.process_iter(["name"]):
        if (server.info["name"] or "").startswith("postgres"):
            try:
                total += sum(server.cpu_times()[:2])
            except psutil.Error:  # exited meanwhile (a connection closed)
                pass
    return total


def instruction_costs(rounds: int, peer_tree: Path | None) -> dict:
    """The API's instructions per request (valgrind's callgrind, counting only while each kind runs):
    unlike CPU time on shared cores, the same count run after run (±0.5% here), so a change of a few
    percent shows. With `peer_tree` (a checkout of another revision: `git worktree add`), its API
    is counted the same way and each kind's ratio printed."""

    def count(tree: Path) -> dict:
        out = Path(f"/tmp/agents-callgrind-{uuid.uuid4().hex[:8]}")
        out.mkdir()
        wrapper = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/run"]
        with serial_api(tree, wrapper, healthy_within=600) as (api, kinds):
            for kind, send in kinds.items():
                for _ in range(max(10, rounds // 10)):  # warm up
                    send()
                subprocess.run(["callgrind_control", "-i", "on", str(api.pid)], check=True, capture_output=True)
                for _ in range(rounds):
                    send()
                subprocess.run(["callgrind_control", "-i", "off", str(api.pid)], check=True, capture_output=True)
                subprocess.run(["callgrind_control", "-d", kind, str(api.pid)], check=True, capture_output=True)  # dumps, then zeroes
        counts = {}
        for dump in sorted(out.glob("run.*"), key=lambda path: int(path.name.rsplit(".", 1)[1])):
            total = next(int(line.split()[1]) for line in dump.read_text().splitlines() if line.startswith("totals:"))
            counts[list(kinds)[len(counts)]] = round(total / rounds / 1e6, 2)
        shutil.rmtree(out)
        return counts

    ours = count(REPO)
    result = {"api_million_instructions": ours, "rounds": rounds}
    if peer_tree is not None:
        peer = count(peer_tree)
        result["peer"] = {"tree": str(peer_tree), "api_million_instructions": peer}
        result["ours_over_peer"] = {kind: round(ours[kind] / peer[kind], 2) for kind in ours if kind in peer}
    return result


class serial_api:
    """One API process (started from `tree`'s code, under `wrapper`) on a fresh PostgreSQL database, two
    hosts registered, one of them running an attempt; yields (the API process, {kind: send one request
    or a pair}). For measures of one request at a time."""

    def __init__(self, tree: Path, wrapper: list[str], healthy_within: float = 60):
        self.tree, self.wrapper, self.healthy_within = tree, wrapper, healthy_within

    def __enter__(self):
        from service.db.migrate import upgrade

        self.url, self.api = fresh_database(), None
        upgrade(self.url)
        tokens, placed = seed(self.url, 2, "s")
        (running, attempt), idle = next(iter(placed.items())), next(name for name in tokens if name not in placed)
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(self.tree), "TRAINYARD_DATABASE_URL": self.url, "TRAINYARD_DATA_DIR": f"/tmp/{self.url.rsplit('/', 1)[1]}"}
        self.api = subprocess.Popen([*self.wrapper, sys.executable, "-m", "trainyard", "api", "--port", str(port)],
                                    cwd=self.tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(f"http://127.0.0.1:{port}", [self.api], timeout=self.healthy_within)
        clients = {name: httpx.Client(base_url=f"http://127.0.0.1:{port}{HOST_API_PREFIX}", headers={"Authorization": f"Bearer {token}"}, timeout=60)
                   for name, token in tokens.items()}
        for client in clients.values():
            client.post("/register", json={"device": "cpu", "slots": 1, "address": "127.0.0.1"}).raise_for_status()
        owner = f"{running}:serial"
        clients[running].post(f"/attempts/{attempt}/claim", json={"lease_owner": owner, "rendezvous": "127.0.0.1:1"}).raise_for_status()
        step = 0

        def post(name: str, path: str, body: dict | None = None) -> None:
            clients[name].post(path, json=body).raise_for_status()

        def lease() -> None:
            post(running, f"/attempts/{attempt}/lease", {"lease_owner": owner})

        def report(renew: bool, steps: int = 5) -> None:
            nonlocal step
            step += steps
            points = [[step - back, metric, 0.5] for back in range(steps) for metric in METRICS]
            post(running, f"/attempts/{attempt}/report", {"lease_owner": owner, "metrics": points, "renew_lease": renew})

        kinds = {
            "idle_heartbeat": lambda: post(idle, "/heartbeat"),
            "lease_renewal": lease,
            "report": lambda: report(False),
            "running_heartbeat_lease_then_report": lambda: (lease(), report(False)),
            "running_heartbeat_report_renewing": lambda: report(True),
            # What each of agents.py's 500 training hosts sends a heartbeat: 5 s of steps at 5 a second.
            "running_heartbeat_report_renewing_175_points": lambda: report(True, steps=25),
        }
        return self.api, kinds

    def __exit__(self, *_):
        try:
            if self.api is not None:
                stop_children([self.api])
        finally:
            drop_database(self.url)


def peer_run(hosts: int, seconds: float) -> dict:
    url = fresh_database()
    try:
        from service.db.migrate import upgrade

        upgrade(url)
        tokens, placed = seed(url, hosts, "p")
        with Watch(url, None, None, []) as watch:
            stats = run_direct_hosts(url, [(name, token, placed.get(name)) for name, token in tokens.items()], seconds)
        return summary(stats, watch, hosts)
    finally:
        drop_database(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--peer-hosts", type=int, default=90)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--warmup", type=float, default=20, help="seconds of Trainyard's runs not measured: the hosts' registrations, claims and first reports")
    parser.add_argument("--no-peer", action="store_true", help="only Trainyard at --hosts: no peer, no run at the peer's load (to compare revisions)")
    parser.add_argument("--processes", type=int, default=2, help="processes the simulated hosts are spread over")
    parser.add_argument("--serial", type=int, metavar="ROUNDS", help="only the API's and PostgreSQL's CPU per request, ROUNDS of each kind one at a time")
    parser.add_argument("--instructions", type=int, metavar="ROUNDS", help="only the API's instructions per request (callgrind), ROUNDS of each kind")
    parser.add_argument("--peer-tree", type=Path, help="with --instructions: a checkout of another revision, counted the same way (the peer)")
    args = parser.parse_args()
    if args.serial:
        print(json.dumps({"benchmark": "agents_serial", **serial_costs(args.serial)}))
        return
    if args.instructions:
        print(json.dumps({"benchmark": "agents_instructions", **instruction_costs(args.instructions, args.peer_tree)}))
        return
    if args.no_peer:
        print(json.dumps({"benchmark": "agents", "trainyard": trainyard_run(args.hosts, args.seconds, args.processes, args.warmup)}))
        return
    peer = peer_run(args.peer_hosts, args.seconds)
    same_load = trainyard_run(args.peer_hosts, args.seconds, args.processes, args.warmup)
    full = trainyard_run(args.hosts, args.seconds, args.processes, args.warmup)
    ratio = (same_load["ingest_p99_ms"] / peer["ingest_p99_ms"]) if peer["ingest_p99_ms"] else None
    print(json.dumps({
        "benchmark": "agents",
        "machine": f"{os.cpu_count()} CPU cores, everything on it (PostgreSQL, 2 API processes, the simulated hosts)",
        "peer_old_design": peer,
        "trainyard_same_load": same_load,
        "trainyard": full,
        "ingest_p99_over_peer_same_load": round(ratio, 2) if ratio else None,
        "connections_over_peer_same_load": round(same_load["postgres_connections_max"] / max(1, peer["postgres_connections_max"]), 2),
        "targets": {"connections": "<= API processes x pool size", "late_renewals": 0, "healthz_p99_ms": 100, "ingest_p99_ms": 250},
    }))


if __name__ == "__main__":
    main()
