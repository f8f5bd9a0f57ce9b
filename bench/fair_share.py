"""Fair share: teams' device-hours against their quotas, on a simulated cluster and arrival trace.

    PYTHONPATH=$PWD .venv/bin/python bench/fair_share.py [--hours 16] [--jobs 5000] [--backend sqlite] [--small-job-weight 5]

The scheduler alone, on a real database, with no training: 100 simulated hosts × 8 CPU slots, three
teams with quotas of 50/30/20% of the slots (400/240/160), three users each, and a trace of
`--jobs` jobs over `--hours` hours, seeded: team A in bursts (a quarter of the trace every four
hours), B and C steady; sizes 1/2/4/8 slots (60/20/12/8%), lengths log-normal around 75 minutes
(10 minutes to 6 hours), about 1.5× what the cluster can run, so queues build. The clock is
moved two minutes at a time (time-machine): each step the jobs due arrive, attempts whose work is
done succeed, an attempt asked to stop does so a step later (its checkpoint) and its job keeps
the work left, and `schedule_pass` runs as the scheduler process would.

The peer is today's scheduler on the same trace: the same code with no teams and no fair share
(priority and aging alone). The teams run also weighs a job's size (`--small-job-weight`, 5 by
default: TRAINYARD_SMALL_JOB_WEIGHT, Slurm's job size factor), so each size's waits and the jobs
never started within the trace are reported too: what favouring small jobs costs the large ones. Reported: each hour's Jain's fairness index of the teams' device-hours
over their entitlements, in the hours where every team had work waiting throughout; utilisation;
p50/p95 wait of 1-slot jobs; preemptions per hour. Targets: fairness ≥ 0.95 in every such hour,
utilisation ≥ 95% of the peer's, p95 wait of 1-slot jobs ≤ 0.5× the peer's. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import time_machine  # noqa: E402
from sqlalchemy import select, update  # noqa: E402

from api_schemas import AttemptStatus  # noqa: E402
from bench.scratch import database  # noqa: E402
from service.db.accounts import create_user  # noqa: E402
from service.db.attempts import claim_attempt, finish_attempt  # noqa: E402
from service.db.hosts import register_host  # noqa: E402
from service.db.jobs import create_job  # noqa: E402
from service.db.models import Attempt, Job, WorkerHost  # noqa: E402
from service.db.session import session_factory  # noqa: E402
from service.db.teams import add_member, create_team  # noqa: E402
from service.scheduler import schedule_pass  # noqa: E402
from common.settings import Settings  # noqa: E402
from tests.helpers import job_spec  # noqa: E402

HOSTS, SLOTS = 100, 8
TEAMS = {"a": 0.5, "b": 0.3, "c": 0.2}
STEP = timedelta(minutes=2)
START = datetime(2026, 1, 5, tzinfo=timezone.utc)


@dataclass
class Arrival:
    at: timedelta
    team: str
    user: int
    slots: int
    seconds: float


def trace(jobs: int, hours: float, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals = []
    for i in range(jobs):
        team = rng.choices(list(TEAMS), weights=[0.5, 0.3, 0.2])[0]
        if team == "a":  # bursty: four bursts, each within ten minutes
            at = timedelta(hours=hours / 4 * rng.randrange(4), minutes=rng.uniform(0, 10))
        else:
            at = timedelta(hours=rng.uniform(0, hours))
        slots = rng.choices([1, 2, 4, 8], weights=[60, 20, 12, 8])[0]
        seconds = min(6 * 3600, max(600, rng.lognormvariate(math.log(75 * 60), 0.8)))
        arrivals.append(Arrival(at, team, rng.randrange(3), slots, seconds))
    return sorted(arrivals, key=lambda a: a.at)


@dataclass
class Outcome:
    used: dict[str, list[tuple[datetime, datetime, int]]] = field(default_factory=lambda: {t: [] for t in TEAMS})
    waits: list[tuple[str, int, float]] = field(default_factory=list)  # (team, slots, seconds from submit to first start)
    submitted: dict[int, int] = field(default_factory=lambda: {n: 0 for n in (1, 2, 4, 8)})  # slots -> jobs submitted
    waiting_all_teams: list[datetime] = field(default_factory=list)  # the steps at which every team had a job queued
    preemptions: int = 0


def simulate(url: str, arrivals: list[Arrival], hours: float, with_teams: bool, small_job_weight: float = 0.0) -> Outcome:
    settings = Settings(
        database_url=url, fair_share_weight=10.0 if with_teams else 0.0, small_job_weight=small_job_weight if with_teams else 0.0,
        lease_seconds=3600, host_timeout_seconds=3600, dispatch_timeout_seconds=3600,
    )
    sessions = session_factory(url)
    outcome = Outcome()
    with time_machine.travel(START, tick=False) as clock, sessions() as session:
        users, team_ids = {}, {}
        for team, share in TEAMS.items():
            created = create_team(session, team, {"cpu": round(share * HOSTS * SLOTS)}) if with_teams else None
            team_ids[team] = created.id if created else None
            for u in range(3):
                user, _ = create_user(session, f"{team}{u}")
                users[team, u] = user
                if created:
                    add_member(session, created, user, default=True)
        for h in range(HOSTS):
            register_host(session, f"host-{h:03d}", "cpu", SLOTS, {})
        session.commit()

        left: dict[int, float] = {}  # job id -> seconds of work left
        team_of: dict[int, str] = {}
        submitted: dict[int, datetime] = {}
        running: dict[int, tuple] = {}  # attempt id -> (held, job id, started, ends, slots)
        stopping: dict[int, datetime] = {}  # attempt id -> when it stops (its checkpoint)
        queued = {t: 0 for t in TEAMS}
        pending = list(arrivals)
        now, end = START, START + timedelta(hours=hours)
        while now < end:
            clock.move_to(now)
            # Arrivals.
            while pending and START + pending[0].at <= now:
                a = pending.pop(0)
                spec = job_spec(name=f"{a.team}-{a.slots}", **{"resources.processes_per_node": a.slots})
                job = create_job(session, users[a.team, a.user], spec, team_id=team_ids[a.team])
                left[job.id], team_of[job.id], submitted[job.id] = a.seconds, a.team, now
                queued[a.team] += 1
                outcome.submitted[a.slots] += 1
            # Work done, and stops asked for a step ago (at their checkpoint).
            for attempt_id, (held, job_id, started, ends, slots) in list(running.items()):
                stop_at = stopping.get(attempt_id)
                if ends <= now or (stop_at is not None and stop_at <= now):
                    finished = min(ends, now)
                    outcome.used[team_of[job_id]].append((started, finished, slots))
                    if ends <= now:
                        finish_attempt(session, held, AttemptStatus.succeeded)
                    else:
                        left[job_id] = (ends - now).total_seconds()
                        finish_attempt(session, held, AttemptStatus.preempted, "stopped at a checkpoint")
                        queued[team_of[job_id]] += 1
                        outcome.preemptions += 1
                    del running[attempt_id]
                    stopping.pop(attempt_id, None)
            asked = session.scalars(select(Attempt.id).where(Attempt.status == AttemptStatus.running, Attempt.preempt_requested)).all()
            for attempt_id in asked:
                stopping.setdefault(attempt_id, now + STEP)
            # The hosts' heartbeats and the running attempts' lease renewals, all at once.
            session.execute(update(WorkerHost).values(last_heartbeat=now))
            session.execute(update(Attempt).where(Attempt.status == AttemptStatus.running).values(lease_expires_at=now + timedelta(hours=1)))
            session.commit()
            # A scheduler pass, its attempts claimed at once by their hosts.
            for attempt_id, _ in schedule_pass(session, settings):
                held = claim_attempt(session, attempt_id, "sim", settings.lease_seconds)
                job = session.get(Job, held.job_id)
                if job.restarts == 0 and len(job.attempts) == 1:
                    outcome.waits.append((team_of[job.id], job.spec["resources"]["processes_per_node"], (now - submitted[job.id]).total_seconds()))
                running[attempt_id] = (held, job.id, now, now + timedelta(seconds=left[job.id]), held.slots)
                queued[team_of[job.id]] -= 1
            if all(queued.values()):
                outcome.waiting_all_teams.append(now)
            now += STEP
        for attempt_id, (held, job_id, started, ends, slots) in running.items():
            outcome.used[team_of[job_id]].append((started, min(ends, end), slots))
    return outcome


def hourly_fairness(outcome: Outcome, hours: float) -> list[float]:
    """Jain's index of (team's share of the hour's device-seconds / its entitlement), for each hour
    in which every team had work waiting at every step."""
    waiting = set(outcome.waiting_all_teams)
    indices = []
    for h in range(int(hours)):
        begin = START + timedelta(hours=h)
        steps = {begin + i * STEP for i in range(int(timedelta(hours=1) / STEP))}
        if not steps <= waiting:
            continue
        end = begin + timedelta(hours=1)
        used = {t: sum(slots * max(0.0, (min(e, end) - max(s, begin)).total_seconds()) for s, e, slots in outcome.used[t]) for t in TEAMS}
        total = sum(used.values())
        x = [used[t] / total / TEAMS[t] for t in TEAMS]
        indices.append(sum(x) ** 2 / (len(x) * sum(v * v for v in x)))
    return indices


def summary(outcome: Outcome, hours: float) -> dict:
    busy = sum(slots * (e - s).total_seconds() for runs in outcome.used.values() for s, e, slots in runs)
    waits = sorted(seconds for _, slots, seconds in outcome.waits if slots == 1)
    p95 = lambda values: round(values[int(0.95 * (len(values) - 1))], 1) if values else None  # noqa: E731
    fairness = hourly_fairness(outcome, hours)
    return {
        "utilisation": round(busy / (HOSTS * SLOTS * hours * 3600), 4),
        "fairness_min": round(min(fairness), 4) if fairness else None,
        "fairness_hours": len(fairness),
        "wait_1slot_p50_s": round(statistics.median(waits), 1) if waits else None,
        "wait_1slot_p95_s": p95(waits),
        "wait_1slot_p95_s_by_team": {t: p95(sorted(s for team, slots, s in outcome.waits if team == t and slots == 1)) for t in TEAMS},
        # What favouring small jobs costs the large ones: each size's waits of the jobs that started, and
        # how many of its jobs never started within the trace.
        "wait_p50_p95_s_by_size": {
            n: [round(statistics.median(w), 1), p95(w)] if (w := sorted(s for _, slots, s in outcome.waits if slots == n)) else None for n in (1, 2, 4, 8)
        },
        "never_started_by_size": {n: count - sum(1 for _, slots, _ in outcome.waits if slots == n) for n, count in outcome.submitted.items()},
        "preemptions_per_hour": round(outcome.preemptions / hours, 2),
        "device_hours": {t: round(sum(slots * (e - s).total_seconds() for s, e, slots in runs) / 3600, 1) for t, runs in outcome.used.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=16)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--small-job-weight", type=float, default=5.0, help="the teams run's TRAINYARD_SMALL_JOB_WEIGHT")
    args = parser.parse_args()
    arrivals = trace(args.jobs, args.hours)
    results = {}
    for name, with_teams in (("peer_priority_aging", False), ("teams_fair_share", True)):
        with database(args.backend) as url:
            results[name] = summary(simulate(url, arrivals, args.hours, with_teams, args.small_job_weight), args.hours)
    peer, ours = results["peer_priority_aging"], results["teams_fair_share"]
    print(json.dumps({
        "bench": "fair_share", "backend": args.backend, "small_job_weight": args.small_job_weight, "hosts": HOSTS, "slots_per_host": SLOTS, "jobs": args.jobs, "hours": args.hours,
        **results,
        "utilisation_ratio": round(ours["utilisation"] / peer["utilisation"], 3),
        "wait_1slot_p95_ratio": round(ours["wait_1slot_p95_s"] / peer["wait_1slot_p95_s"], 3) if peer["wait_1slot_p95_s"] else None,
        "targets": {"fairness_min": 0.95, "utilisation_ratio": 0.95, "wait_1slot_p95_ratio": 0.5},
    }))


if __name__ == "__main__":
    main()
