"""Places queued jobs on worker hosts and notices attempts whose worker went away.

One pass = one transaction: reap lost attempts, re-send dispatches nobody claimed, place queued
jobs on hosts with free slots. Tasks are sent only after the transaction commits, so a worker
never receives an attempt that isn't in the database yet.
"""

from __future__ import annotations

import itertools
import logging
import time
from datetime import timedelta

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import AttemptStatus, JobSpec
from service import state
from service.db import crud
from service.db.models import utcnow
from service.queue import dispatch_attempt
from service.settings import Settings

log = logging.getLogger("trainyard.scheduler")


def schedule_pass(session: Session, settings: Settings) -> list[tuple[int, str]]:
    """Run one pass and commit it; returns (attempt_id, host_name) pairs to dispatch."""
    now = utcnow()
    crud.lock_scheduler(session)

    # Attempts whose worker stopped renewing the lease: the worker (or its host) is gone.
    for attempt in crud.expired_leases(session, now):
        state.end_attempt(session, attempt.job, attempt, AttemptStatus.lost, reason=f"worker on host {attempt.host_name} stopped renewing its lease")
        log.warning("attempt %s of job %s lost (lease expired)", attempt.id, attempt.job_id)

    hosts = crud.online_hosts(session, now, settings.host_timeout_seconds)
    online = {host.name for host in hosts}

    # Dispatches nobody claimed: given back at once if their host went away, re-sent after a
    # timeout if it is alive (the message may have been lost; a duplicate is harmless).
    to_dispatch: list[tuple[int, str]] = []
    resend_before = now - timedelta(seconds=settings.dispatch_timeout_seconds)
    for attempt in crud.unclaimed_attempts(session, online, resend_before):
        if attempt.host_name not in online:
            state.end_attempt(session, attempt.job, attempt, AttemptStatus.lost, reason=f"host {attempt.host_name} went offline before starting it")
        elif attempt.dispatched_at < resend_before:
            attempt.dispatched_at = now
            to_dispatch.append((attempt.id, attempt.host_name))

    # Place queued jobs, best fit: the hosts with the fewest free slots that still fit. A gang
    # (nodes > 1) gets all its hosts in this one transaction or none, so two gangs can never each
    # hold half of what they need and wait on each other forever.
    busy = crud.busy_slots_by_host(session)
    free = {host.name: host.slots - busy.get(host.name, 0) for host in hosts}
    device = {host.name: host.device for host in hosts}
    # Hosts are chosen job by job, then all placements written at once. The queued jobs' rows are
    # locked by this pass, so none is taken meanwhile; if one were, it would only leave its slots
    # unused until the next pass.
    placements = []
    for job in crud.queued_jobs(session, limit=200):
        resources = JobSpec.model_validate(job.spec).resources
        fitting = sorted((h for h in free if device[h] == resources.device and free[h] >= resources.processes_per_node),
                         key=lambda h: (free[h], h))
        if len(fitting) < resources.nodes:
            continue
        for host in fitting[: resources.nodes]:
            free[host] -= resources.processes_per_node
        placements.append((job, fitting[: resources.nodes], resources.processes_per_node))
    attempts = crud.place_jobs(session, placements, now)
    to_dispatch += [(attempt.id, attempt.host_name) for attempt in attempts]
    for job_id, gang in itertools.groupby(attempts, key=lambda attempt: attempt.job_id):
        gang = list(gang)
        log.info("job %s attempt %s placed on %s", job_id, gang[0].number, ", ".join(a.host_name for a in gang))

    session.commit()
    return to_dispatch


def _send(celery: Celery, attempt_id: int, host: str) -> None:
    """Send one dispatch, retrying once at once: a first send can race the worker declaring the
    same queue (seen with the SQLAlchemy transport). If both fail, the pass after the dispatch
    timeout re-sends it; one failed send never holds up the others."""
    for last_try in (False, True):
        try:
            dispatch_attempt(celery, attempt_id, host)
            return
        except Exception:
            if last_try:
                log.exception("could not dispatch attempt %s to %s; it is re-sent after the dispatch timeout", attempt_id, host)


def run_scheduler(sessions: sessionmaker, celery: Celery, settings: Settings, stop=lambda: False) -> None:
    """The scheduler process: one pass every `scheduler_interval_seconds` until `stop()`."""
    log.info("scheduler started")
    while not stop():
        try:
            with sessions() as session:
                dispatches = schedule_pass(session, settings)
            for attempt_id, host in dispatches:
                _send(celery, attempt_id, host)
        except Exception:
            # A database or broker restart must not kill the scheduler; the next pass retries.
            log.exception("scheduler pass failed; retrying")
            time.sleep(2)
        time.sleep(settings.scheduler_interval_seconds)
