"""Places queued jobs on worker hosts and notices attempts whose worker went away; after each pass,
the sweep controller (service/sweeps.py) submits and prunes sweeps' trials.

One pass = one transaction: reap lost attempts, re-send dispatches nobody claimed, place queued
jobs on hosts with free slots, and hand the jobs that name a cluster pool to it. The execution
backends (service/backends/) are given the placed attempts only after the transaction commits,
so a worker never receives an attempt that isn't in the database yet.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import AttemptStatus, JobSpec, ResourcesConfig
from service.db import state
from service.db.api_processes import api_up_since, beat_seconds
from service.db.doorbell import Doorbell
from service.db.scheduler_processes import note_scheduler_pass
from service.db.models import Attempt, Job, utcnow
from service.db.pools import pool_named, slot_capacity
from service.backends import ExecutionBackend, cluster_pools
from service.backends.hosts import HostsBackend
from service.db.scheduling import (
    expired_leases,
    lock_scheduler,
    online_hosts_with_load,
    place_jobs,
    pool_host,
    pool_of,
    preemptible_attempts,
    queued_jobs,
    request_preemption,
    set_waiting_reason,
    shrunk_attempts,
    unclaimed_attempts,
)
from service.logs import job_fields
from service.placement import HostRoom, Rooms, preemption_plan, waiting_reason
from common.settings import Settings
from service.db.teams import resources_of
from service.fair_share import FairShare, Quotas, load_fair_share, load_quotas, pool_reclaims, reclaimable_attempts
from service.sweeps import advance_sweeps

log = logging.getLogger("trainyard.scheduler")


def schedule_pass(session: Session, settings: Settings, reap: bool = True) -> list[tuple[int, str]]:
    """Run one pass and commit it; returns (attempt_id, host_name) pairs to start: sent to their
    host, or, where the host is a pool's (pool_of), handed to that pool. Without `reap`, only
    placement: lost workers and unclaimed dispatches are looked for by other passes."""
    now = utcnow()
    lock_scheduler(session)
    # Leases and hosts are judged only once hosts have had an API to renew through for a whole lease:
    # with none up (stopped, or cut off from the database), every host is silent and none is gone.
    judging = reap and hosts_could_renew(session, now, settings)

    # Attempts whose worker stopped renewing the lease: the worker (or its host) is gone.
    for attempt in expired_leases(session, now) if judging else []:
        if attempt.status != AttemptStatus.running:
            continue  # ended with its gang's node ended just before it in this loop
        state.end_attempt(session, attempt.job, attempt, AttemptStatus.lost, reason=f"worker on host {attempt.host_name} stopped renewing its lease")
        log.warning("attempt %s of job %s lost (lease expired)", attempt.id, attempt.job_id, extra=job_fields(attempt.job_id, attempt.id))

    hosts, busy_slots, busy_gpus = online_hosts_with_load(session, now, settings.host_timeout_seconds)
    online = {host.name for host in hosts}

    # Dispatches nobody claimed: given back at once if their host went away, re-sent after a
    # timeout if it is alive (the message may have been lost; a duplicate is harmless).
    to_dispatch: list[tuple[int, str]] = []
    resend_before = now - timedelta(seconds=settings.dispatch_timeout_seconds)
    for attempt in unclaimed_attempts(session, online, resend_before) if reap else []:
        if attempt.status != AttemptStatus.scheduled:
            continue  # ended with its gang's node ended just before it in this loop
        if attempt.host_name not in online:
            if judging:
                state.end_attempt(session, attempt.job, attempt, AttemptStatus.lost, reason=f"host {attempt.host_name} went offline before starting it")
        elif attempt.dispatched_at < resend_before:
            attempt.dispatched_at = now
            to_dispatch.append((attempt.id, attempt.host_name))

    # Place queued jobs, best fit: the hosts with the least room that still fit. A gang (nodes > 1)
    # gets all its hosts in this one transaction or none, so two gangs can never each hold half of
    # what they need and wait on each other forever. Order: priority, raised the longer a job has
    # waited (aging, so a low priority is never starved) and by its team's and user's fair share,
    # then first come first served. Jobs within their team's quota go first; a job beyond it only
    # borrows what is left idle after them (service/fair_share.py).
    rooms = Rooms(hosts, busy_slots, busy_gpus)
    quotas = load_quotas(session)
    queued = queued_jobs(session, limit=1000)
    shares = load_fair_share(session, quotas, now, settings.fair_share_half_life_seconds, settings.fair_share_update_seconds, queued)
    stoppable: Stoppable | None = None  # read only when a job has to wait: most passes need none
    reserved: set[str] = set()
    # Hosts are chosen job by job, then all placements written at once. The queued jobs' rows are
    # locked by this pass, so none is taken meanwhile; if one were, it would only leave its room
    # unused until the next pass.
    placements = []
    to_pools: dict[str, list] = {}
    borrowing: list[tuple[Job, ResourcesConfig]] = []
    borrowing_in_pools: list[tuple[Job, ResourcesConfig]] = []

    def take(job: Job, resources: ResourcesConfig, chosen: list, processes: int) -> None:
        for name, devices in chosen:
            rooms.take(name, processes, devices)
        quotas.take(job.team_id, resources.slot_kind, len(chosen) * processes)
        placements.append((job, chosen, processes))

    def hand_to_pool(job: Job, resources: ResourcesConfig) -> None:
        # Its cluster places it (and queues it, if full): handed over in this order, at once.
        quotas.take(job.team_id, resources.slot_kind, resources.slots)
        nodes = [(pool_host(resources.pool, job.id), None)] * resources.nodes
        to_pools.setdefault(resources.pool, []).append((job, nodes, resources.processes_per_node))

    for job in queue_order(queued, now, settings, shares):
        # Only the resources: the spec was validated whole when admitted, and validating all of it
        # again for each of 10,000 jobs cost a tenth of the pass.
        resources = ResourcesConfig.from_stored(job.spec.get("resources", {}))
        if resources.pool is not None:
            if resources.pool not in cluster_pools(settings):
                set_waiting_reason(job, f"waiting for pool {resources.pool!r}, which this scheduler is not configured to run")
                continue
            if quotas.within(job.team_id, resources.slot_kind, resources.slots):
                hand_to_pool(job, resources)
            else:
                borrowing_in_pools.append((job, resources))
            continue
        if not quotas.within(job.team_id, resources.slot_kind, resources.slots):
            borrowing.append((job, resources))
            continue
        chosen, processes = rooms.best_fit(resources, skip=reserved), resources.processes_per_node
        if chosen is None and resources.elastic and (now - (job.queued_at or job.created_at)).total_seconds() >= resources.elastic.wait_s:
            chosen, processes = smaller_fit(rooms, JobSpec.from_stored(job.spec), skip=reserved)
        if chosen is None:
            reason = waiting_reason(resources, rooms.fitting_now(resources, skip=reserved), len(hosts))
            if resources.elastic:
                reason += f"; elastic: runs on as few as {resources.elastic.min_processes} process(es) if still queued after {resources.elastic.wait_s:g} s"
            # The first job that must wait gets hosts held for it: nothing behind it starts there,
            # so jobs that fit elsewhere go on (backfill) without ever delaying its start.
            could_ever = [] if reserved else rooms.could_ever(resources, skip=reserved)
            if len(could_ever) >= resources.nodes:
                # Sooner still if stopping jobs (at a checkpoint) makes room: other teams' borrowed
                # slots, which its team's quota may take back; else lower-priority preemptible jobs.
                if stoppable is None:
                    stoppable = Stoppable.read(session, quotas)
                held, why = hold_for(job, resources, {name: rooms.room[name] for name in could_ever}, stoppable, quotas)
                reserved.update(held)
                reason += f"; {', '.join(held)} held for it" + (f" ({why})" if why else "")
            set_waiting_reason(job, reason)
            continue
        take(job, resources, chosen, processes)

    # Beyond their team's quota, on what the jobs within theirs left idle: no host is held and
    # nothing stopped for them, and what they take is reclaimed when its owners want it.
    for job, resources in borrowing:
        chosen = rooms.best_fit(resources, skip=reserved)
        if chosen is None:
            reason = waiting_reason(resources, rooms.fitting_now(resources, skip=reserved), len(hosts))
            set_waiting_reason(job, f"{quotas.describe(job.team_id, resources.slot_kind)}; it borrows idle slots beyond it: {reason}")
            continue
        take(job, resources, chosen, resources.processes_per_node)
    # In a cluster pool, beyond their team's quota: what the pool has idle (its slots less what
    # Trainyard's jobs hold there); and what borrowers hold there taken back, at their next
    # checkpoint, where jobs within their quotas were handed to a pool it leaves full.
    if quotas.nominal and (borrowing_in_pools or to_pools):
        pools = {pool: pool_named(session, pool) for pool in cluster_pools(settings)}
        for job, resources in borrowing_in_pools:
            kind, slots = resources.slot_kind, resources.slots
            capacity, held = slot_capacity(pools[resources.pool], resources.device), quotas.held_by_all(kind)
            if capacity is None or held + slots > capacity:
                idle = f"{max(0, capacity - held)} of its {capacity} slots idle" if capacity is not None else "not described yet"
                set_waiting_reason(job, f"{quotas.describe(job.team_id, kind)}; it borrows idle slots of pool {resources.pool} beyond it: {idle}")
                continue
            hand_to_pool(job, resources)
        for pool, row in pools.items():
            for device in ("cpu", "cuda"):
                kind = f"{pool}/{device}"
                if quotas.governed(kind) and (capacity := slot_capacity(row, device)) is not None:
                    for attempt in pool_reclaims(session, quotas, pool, kind, capacity):
                        request_preemption(attempt, f"reclaimed for a team's quota of {kind}")
                        log.info("stopping job %s in pool %s: its borrowed %s slots reclaimed", attempt.job_id, pool, kind,
                                 extra=job_fields(attempt.job_id, attempt.id))
    attempts = place_jobs(session, placements, now)
    for pool, handed in to_pools.items():
        attempts += place_jobs(session, handed, now, pool=pool)

    # Elastic jobs running on fewer processes than their own go back to it once it is free: asked
    # to stop at a checkpoint, as a preempted job is, they are queued again (no restart counted)
    # and placed at full size, where they were or elsewhere. Checked after this pass's placements,
    # so only room nobody queued wanted is taken back.
    for attempt in shrunk_attempts(session):
        if not attempt.preempt_requested and full_size_fits(rooms, attempt, skip=reserved):
            request_preemption(attempt)
            log.info("job %s goes back to its full size (running on %s processes)", attempt.job_id, attempt.slots, extra=job_fields(attempt.job_id, attempt.id))
    to_dispatch += [(attempt.id, attempt.host_name) for attempt in attempts]
    for job_id, gang in itertools.groupby(attempts, key=lambda attempt: attempt.job_id):
        gang = list(gang)
        hosts = ", ".join(a.host_name for a in gang)
        log.info("job %s attempt %s placed on %s", job_id, gang[0].number, hosts, extra=job_fields(job_id, gang[0].id, host=hosts))

    session.commit()
    return to_dispatch


def smaller_fit(rooms: Rooms, spec: JobSpec, skip: set[str]) -> tuple[list | None, int]:
    """An elastic job's largest smaller size that fits now: (its hosts, its processes), or (None, 0)."""
    for processes in spec.elastic_sizes()[1:]:
        if (chosen := rooms.best_fit(spec.placed_on(processes).resources, skip=skip)) is not None:
            return chosen, processes
    return None, 0


def full_size_fits(rooms: Rooms, attempt: Attempt, skip: set[str]) -> bool:
    """Whether an elastic attempt's job would fit at its full size now: on its own host once the
    attempt's devices are counted free, or on another."""
    full = JobSpec.from_stored(attempt.job.spec).resources
    if rooms.best_fit(full, skip=skip) is not None:
        return True
    own = rooms.room.get(attempt.host_name)
    if own is None or attempt.host_name in skip:
        return False
    own.give_back(attempt.slots, attempt.device_ids)
    fits = own.offer(full) is not None
    own.take(attempt.slots, attempt.device_ids or [])
    return fits


_said_api_down_at = 0.0  # when the scheduler last logged that it judges no lease (once a minute)


def hosts_could_renew(session: Session, now: datetime, settings: Settings) -> bool:
    """Whether some API process has been up without a break for a whole lease (service/db/api_processes.py)."""
    global _said_api_down_at
    up_since = api_up_since(session, now, beat_seconds(settings.lease_seconds))
    if up_since is not None and up_since <= now - timedelta(seconds=settings.lease_seconds):
        return True
    if time.monotonic() - _said_api_down_at >= 60:
        _said_api_down_at = time.monotonic()
        if up_since is None:
            log.warning("no API process is up: no lease is judged lost until one has been for a lease (%g s)", settings.lease_seconds)
        else:
            log.info("the API is up since %s: leases are judged once it has been for a lease (%g s)", up_since.isoformat(timespec="seconds"), settings.lease_seconds)
    return False


def queue_order(jobs: list[Job], now: datetime, settings: Settings, shares: FairShare) -> list[Job]:
    """Highest effective priority first: priority, one point more per `priority_aging_seconds`
    queued, up to `fair_share_weight` points for its team's and user's fair share, and
    `small_job_weight` over its slots for its size."""

    def effective(job: Job) -> float:
        resources = resources_of(job)
        waited = (now - job.created_at).total_seconds() / settings.priority_aging_seconds
        fair_share = settings.fair_share_weight * shares.factor(job.owner_id, job.team_id, resources.slot_kind)
        return job.priority + waited + fair_share + settings.small_job_weight / resources.slots

    return sorted(jobs, key=lambda job: (-effective(job), job.id))


@dataclass
class Stoppable:
    """The running attempts a waiting job might have stopped, and which of them hold borrowed slots."""

    preemptible: list[Attempt]
    governed: list[Attempt]  # on device kinds some team has a quota of
    borrowed: set[int]

    @classmethod
    def read(cls, session: Session, quotas: Quotas) -> Stoppable:
        governed, borrowed = reclaimable_attempts(session, quotas)
        running = [attempt for attempt in governed if attempt.status == AttemptStatus.running]
        return cls(preemptible_attempts(session), running, borrowed)


def hold_for(job: Job, resources: ResourcesConfig, rooms: dict[str, HostRoom], stoppable: Stoppable, quotas: Quotas) -> tuple[list[str], str]:
    """The hosts held for the first job that must wait, and, where it waits for attempts that stop
    for it, why in words. Its team's quota takes back other teams' borrowed slots first (any job
    that borrowed may be stopped so); else a higher priority preempts preemptible jobs, but never a
    team's jobs within its quota for another team's. (Attempts already asked to stop count as gone.)"""
    team, governed = job.team_id, quotas.governed(resources.device)
    plan = preemption_plan(resources, rooms, stoppable.governed, lambda a: a.id in stoppable.borrowed and a.job.team_id != team) if governed else None
    if plan is not None:
        lenders = ", ".join(sorted({quotas.name(victim.job.team_id) for victim in plan.victims}))
        slots = sum(victim.slots for victim in plan.victims)
        why = f"{slots} slot{'s' if slots != 1 else ''} borrowed by {lenders} reclaimed at their next checkpoint" if slots else "borrowed slots being reclaimed"
        stop_reason = f"reclaimed for {quotas.name(team)}'s quota (job {job.id})"
    else:
        plan = preemption_plan(
            resources, rooms, stoppable.preemptible,
            lambda a: a.job.priority < job.priority and (not governed or a.job.team_id == team or a.id in stoppable.borrowed),
        )
        why, stop_reason = "preempting lower priorities", None
    if plan is None:
        return sorted(rooms, key=lambda name: (-rooms[name].free, name))[: resources.nodes], ""
    for victim in plan.victims:
        request_preemption(victim, stop_reason)
        log.info("stopping job %s on %s for job %s: %s", victim.job_id, victim.host_name, job.id, why, extra=job_fields(victim.job_id, victim.id))
    return plan.hosts, why


def execution_backends(sessions: sessionmaker, celery: Celery, settings: Settings) -> dict[str | None, ExecutionBackend]:
    """By pool: None, Trainyard's own hosts; a cluster pool's name, its backend."""
    backends: dict[str | None, ExecutionBackend] = {None: HostsBackend(celery)}
    if settings.slurm_pool in cluster_pools(settings):
        from service.backends.slurm import SlurmBackend

        backends[settings.slurm_pool] = SlurmBackend(sessions, settings)
        log.info("Slurm pool %r: partition %s, through %s", settings.slurm_pool, settings.slurm_partition,
                 f"slurmrestd at {settings.slurm_rest_url}" if settings.slurm_rest_url else "Slurm's commands")
    return backends


def start_placed(backends: dict[str | None, ExecutionBackend], placed: list[tuple[int, str]]) -> None:
    by_pool: dict[str | None, list[tuple[int, str]]] = {}
    for attempt_id, host in placed:
        by_pool.setdefault(pool_of(host), []).append((attempt_id, host))
    for pool, attempts in by_pool.items():
        if (backend := backends.get(pool)) is None:
            log.error("attempts %s are in pool %r, which this scheduler has no backend for", [a for a, _ in attempts], pool)
            continue
        backend.start(attempts)


def run_scheduler(
    sessions: sessionmaker, celery: Celery, settings: Settings, stop=lambda: False, interrupt: socket.socket | None = None
) -> None:
    """The scheduler process: a pass whenever the doorbell rings (a job queued, devices freed, a
    host registered), and at least every `scheduler_interval_seconds`, until `stop()`, checked
    after each pass and whenever `interrupt` has data (see Doorbell)."""
    log.info("scheduler started")
    backends = execution_backends(sessions, celery, settings)
    doorbell = Doorbell(settings.resolved_database_url, interrupt)
    rang, last_reaped = False, 0.0
    name = f"{socket.gethostname()}:{os.getpid()}"
    while not stop():
        # A ring means work to place, so that pass only places, a few statements sooner; leases
        # and dispatches are looked at by the other passes, at least every interval.
        reap = not rang or time.monotonic() - last_reaped >= settings.scheduler_interval_seconds
        try:
            with sessions() as session:
                dispatches = schedule_pass(session, settings, reap=reap)
                if reap:  # at least every interval: the API tells when no scheduler runs
                    note_scheduler_pass(session, name, utcnow())
            last_reaped = time.monotonic() if reap else last_reaped
            start_placed(backends, dispatches)
            if reap:  # with the pass's own reaping, not on every ring: a cluster's commands are round trips
                for backend in backends.values():
                    backend.sync()  # outside the pass's transaction
            advance_sweeps(sessions, settings)  # trials it submits ring the doorbell: placed by the next pass
        except Exception:
            # A database or broker restart must not kill the scheduler; the next pass retries.
            log.exception("scheduler pass failed; retrying")
            time.sleep(2)
        rang = doorbell.wait(settings.scheduler_interval_seconds)
    doorbell.close()
