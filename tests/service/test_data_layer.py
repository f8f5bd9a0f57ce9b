"""The state machine and data-access module against both SQLite and the real PostgreSQL."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import select

from api_schemas import AttemptStatus, JobStatus
from api_schemas.manifest import MODEL_FILE, sha256_file, write_manifest
from service.db import state
from service.db.accounts import create_user, user_by_name, user_by_token
from service.db.api_processes import api_up_since, beat_seconds, note_api_up
from api_schemas.host_api import ClaimedAttempt
from service.db.attempts import claim_attempt, finish_attempt, gang_rendezvous, renew_lease
from service.db.checkpoints import list_checkpoints, record_checkpoint
from service.db.doorbell import Doorbell, ring, socket_path
from service.db.hosts import deregister_host, register_host
from service.db.jobs import QuotaExceeded, create_job, job_events_after, request_cancel
from service.db.log_lines import lock_job_logs, log_lines_after, record_logs
from service.db.metrics import metric_series, record_metrics
from service.db.models import Attempt, Base, Job, LogLine, Metric, User, WorkerHost, utcnow
from service.db.session import session_factory
from service.fair_share import FairShare, Quotas
from service.scheduler import queue_order, schedule_pass
from common.settings import Settings
from tests.helpers import busy_slots_by_host, directory_on_another_filesystem, host_client, job_spec
from workers import supervisor
from workers.outbox import Outbox, Transfers
from workers.supervisor import AttemptRunner


@pytest.fixture
def sessions(database_url):
    return session_factory(database_url)


def queue_job(sessions, **overrides) -> int:
    with sessions() as session:
        user = user_by_name(session, "alice") or create_user(session, "alice")[0]
        return create_job(session, user, job_spec(**overrides)).id


def place_and_claim(sessions, settings, owner="w1") -> ClaimedAttempt:
    with sessions() as session:
        register_host(session, "host-a", "cpu", 2, {})
        [(attempt_id, host)] = schedule_pass(session, settings)
    with sessions() as session:
        claimed = claim_attempt(session, attempt_id, owner, settings.lease_seconds)
    assert claimed is not None
    return claimed


def test_job_moves_through_allowed_transitions_only(sessions):
    job_id = queue_job(sessions)
    with sessions() as session:
        job = session.get(Job, job_id)
        with pytest.raises(state.InvalidTransition):
            state.move_job(session, job, JobStatus.succeeded)
        assert state.move_job(session, job, JobStatus.scheduled)
        assert state.move_job(session, job, JobStatus.running)
        assert job.started_at is not None
        assert state.move_job(session, job, JobStatus.succeeded)
        assert job.finished_at is not None
        session.commit()
        with pytest.raises(state.InvalidTransition):
            state.move_job(session, job, JobStatus.queued)


def test_a_stale_transition_loses_the_race_instead_of_overwriting(sessions):
    job_id = queue_job(sessions)
    with sessions() as first, sessions() as second:
        stale = second.get(Job, job_id)  # read while still queued
        second.commit()
        assert state.move_job(first, first.get(Job, job_id), JobStatus.cancelled)
        first.commit()
        assert not state.move_job(second, stale, JobStatus.scheduled)
        assert stale.status == JobStatus.cancelled


def test_a_second_delivery_of_the_same_attempt_is_a_no_op(sessions, settings):
    queue_job(sessions)
    claimed = place_and_claim(sessions, settings, owner="first")
    with sessions() as session:
        assert claim_attempt(session, claimed.attempt_id, "second", settings.lease_seconds) is None
        attempt = session.get(Attempt, claimed.attempt_id)
        assert attempt.lease_owner == "first" and attempt.status == AttemptStatus.running
        assert attempt.job.status == JobStatus.running


def test_an_expired_lease_requeues_the_job_and_the_old_worker_cannot_finish_it(sessions, settings):
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        attempt = session.get(Attempt, claimed.attempt_id)
        attempt.lease_expires_at = utcnow() - timedelta(seconds=1)
        attempt.job.cancel_requested = False
        session.commit()
        # The host stays registered but the job needs a new placement: it is queued again first.
        schedule_pass(session, settings)
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job.attempts[0].status == AttemptStatus.lost
        assert "stopped renewing its lease" in job.attempts[0].failure_reason
        assert job.restarts == 1
        assert job.status == JobStatus.scheduled and len(job.attempts) == 2  # placed again in the same pass
        assert not renew_lease(session, claimed, 30).held
        assert not finish_attempt(session, claimed, AttemptStatus.succeeded)


def test_no_lease_is_judged_lost_while_no_api_is_up_nor_until_one_has_been_for_a_whole_lease(sessions, settings):
    # Hosts renew only through the API: while it is down (stopped, or cut off from the database) every
    # host is silent, and reaping then would end every running attempt of the cluster.
    queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    lease, beat = timedelta(seconds=settings.lease_seconds), beat_seconds(settings.lease_seconds)
    start = utcnow() - 3 * lease
    with sessions() as session:
        note_api_up(session, "api-1", start, beat)  # up until then, then silent: down
        session.get(Attempt, claimed.attempt_id).lease_expires_at = utcnow() - timedelta(seconds=1)
        session.commit()
        schedule_pass(session, settings)
        assert session.get(Attempt, claimed.attempt_id).status == AttemptStatus.running

        # Back, after a break: up since now, not yet for a lease.
        note_api_up(session, "api-1", utcnow(), beat)
        schedule_pass(session, settings)
        assert session.get(Attempt, claimed.attempt_id).status == AttemptStatus.running

        # Another process, up without a break for a lease: the silent host is gone.
        for seconds in range(int(lease.total_seconds() + 2 * beat), -1, -int(beat)):
            note_api_up(session, "api-2", utcnow() - timedelta(seconds=seconds), beat)
        assert api_up_since(session, utcnow(), beat) <= utcnow() - lease
        schedule_pass(session, settings)
        assert session.get(Attempt, claimed.attempt_id).status == AttemptStatus.lost


def test_a_placing_pass_leaves_expired_leases_to_the_next_reaping_pass(sessions, settings):
    # The scheduler's passes woken by the doorbell only place (a job's start is sooner by the
    # statements saved); the passes at least every interval reap.
    queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        session.get(Attempt, claimed.attempt_id).lease_expires_at = utcnow() - timedelta(seconds=1)
        session.commit()
    waiting_id = queue_job(sessions)  # host-a has a second slot for it
    with sessions() as session:
        schedule_pass(session, settings, reap=False)
    with sessions() as session:
        assert session.get(Attempt, claimed.attempt_id).status == AttemptStatus.running
        assert session.get(Job, waiting_id).status == JobStatus.scheduled
        schedule_pass(session, settings)
    with sessions() as session:
        assert session.get(Attempt, claimed.attempt_id).status == AttemptStatus.lost


def test_restarts_exhausted_fail_the_job_with_the_attempt_reason(sessions, settings):
    job_id = queue_job(sessions, max_restarts=0)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        assert finish_attempt(session, claimed, AttemptStatus.failed, "exit code 1: boom")
        job = session.get(Job, job_id)
        assert job.status == JobStatus.failed
        assert "boom" in job.failure_reason


def test_a_failure_no_retry_can_mend_fails_the_job_at_once_with_restarts_left(sessions, settings):
    job_id = queue_job(sessions, max_restarts=3)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        assert finish_attempt(session, claimed, AttemptStatus.failed, "invalid job spec: too few windows", retry=False)
        job = session.get(Job, job_id)
        assert job.status == JobStatus.failed and job.restarts == 0
        assert job.failure_reason == "attempt 1 failed, not retried: invalid job spec: too few windows"


def test_cancel_reaches_a_running_attempt_through_its_lease(sessions, settings):
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        request_cancel(session, session.get(Job, job_id))
        lease = renew_lease(session, claimed, 30)
        assert lease.held and lease.cancel_requested
        finish_attempt(session, claimed, AttemptStatus.cancelled, "cancelled by user")
        assert session.get(Job, job_id).status == JobStatus.cancelled


def test_a_job_cancelled_while_its_retry_runs_says_it_was_cancelled_not_that_it_is_retrying(sessions, settings):
    job_id = queue_job(sessions, max_restarts=1)
    with sessions() as session:
        finish_attempt(session, place_and_claim(sessions, settings, owner="w1"), AttemptStatus.failed, "exit code 1")
        assert session.get(Job, job_id).failure_reason == "retrying after attempt 1: exit code 1"
    retry = place_and_claim(sessions, settings, owner="w2")
    with sessions() as session:
        request_cancel(session, session.get(Job, job_id))
        finish_attempt(session, retry, AttemptStatus.cancelled, "cancelled by user")
        job = session.get(Job, job_id)
        assert (job.status, job.failure_reason) == (JobStatus.cancelled, "cancelled by user")


def test_metrics_are_idempotent_per_job_step_and_name(sessions, settings):
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        record_metrics(session, job_id, claimed.attempt_id, [(1, "train_loss", 4.0), (2, "train_loss", 3.5)])
        record_metrics(session, job_id, claimed.attempt_id, [(2, "train_loss", 3.4), (3, "train_loss", 3.0)])
        rows = session.execute(select(Metric.step, Metric.value).where(Metric.job_id == job_id).order_by(Metric.step)).all()
        assert [tuple(r) for r in rows] == [(1, 4.0), (2, 3.4), (3, 3.0)]
        assert session.get(Job, job_id).step == 3


def test_any_metric_name_and_value_a_script_logs_is_stored_and_read_back_exactly(sessions, settings):
    # accelerator.log keys are the user's: names that need quoting in an array literal, values at the edges of a double.
    names = ['eval/loss', 'a "quoted" name', 'back\\slash', 'comma,brace}{', ' spaced ', 'NULL', 'ünïcode λ', '']
    values = [1e-300, -2.5e300, 0.1 + 0.2, 5e-324, -0.0, 123456789.123456789, 1 / 3, 7.0]
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        record_metrics(session, job_id, claimed.attempt_id, [(4, name, value) for name, value in zip(names, values)])
        stored = dict(session.execute(select(Metric.name, Metric.value).where(Metric.job_id == job_id)).all())
    assert stored == dict(zip(names, values))
    with sessions() as session:
        series = metric_series(session, job_id, None, None, 100)
    assert {name: values for name, (_, values) in series.items()} == {name: [value] for name, value in zip(names, values)}


def test_scheduler_places_by_priority_and_only_where_slots_are_free(sessions, settings):
    low = queue_job(sessions, priority=0)
    high = queue_job(sessions, priority=5)
    wide = queue_job(sessions, priority=9, **{"resources.processes_per_node": 4})
    with sessions() as session:
        register_host(session, "host-a", "cpu", 1, {})
        placed = schedule_pass(session, settings)
        assert len(placed) == 1
        assert session.get(Job, high).status == JobStatus.scheduled
        assert session.get(Job, low).status == JobStatus.queued
        assert session.get(Job, wide).status == JobStatus.queued  # needs 4 slots, the host has 1


def test_a_backlog_is_placed_highest_priority_first_and_no_host_past_its_slots(sessions, settings):
    # One pass writes all its placements at once; the jobs that win must be those that would win one by one.
    priorities = [3, 0, 7, 7, 1, 5, 0, 9, 2, 5, 4, 8, 6, 1, 3, 9, 2, 6, 8, 4]
    wide = {2, 9, 15}  # these need 2 slots
    jobs = [queue_job(sessions, priority=p, **({"resources.processes_per_node": 2} if i in wide else {})) for i, p in enumerate(priorities)]
    with sessions() as session:
        register_host(session, "host-a", "cpu", 3, {})
        register_host(session, "host-b", "cpu", 4, {})
        placed = schedule_pass(session, settings)
        assert schedule_pass(session, settings) == []  # every slot taken
    # Priority order 7 (9), 15 (9, wide), 11 (8), 18 (8), 2 (7, wide) fills the 7 slots, best fit first.
    expected = {jobs[7]: "host-a", jobs[15]: "host-a", jobs[11]: "host-b", jobs[18]: "host-b", jobs[2]: "host-b"}
    with sessions() as session:
        attempts = session.scalars(select(Attempt)).all()
        assert {a.job_id: a.host_name for a in attempts} == expected
        assert sorted(placed) == sorted((a.id, a.host_name) for a in attempts)
        assert busy_slots_by_host(session) == {"host-a": 3, "host-b": 4}
        for job_id in jobs:
            statuses = [data["status"] for _, _, data in job_events(session, job_id)]
            assert statuses == (["queued", "scheduled"] if job_id in expected else ["queued"])
            assert session.get(Job, job_id).status == (JobStatus.scheduled if job_id in expected else JobStatus.queued)

        # A placement given back is placed again with the next attempt number, still first in line.
        first = session.scalar(select(Attempt).where(Attempt.job_id == jobs[7]))
        assert state.end_attempt(session, first.job, first, AttemptStatus.lost, reason="host went away")
        session.commit()
        [(attempt_id, host)] = schedule_pass(session, settings)
        again = session.get(Attempt, attempt_id)
        assert (again.job_id, again.number, host) == (jobs[7], 2, "host-a")


def test_tries_that_keep_ending_before_they_start_fail_the_job_instead_of_looping(sessions, settings):
    # Seen on a Slurm pool whose every batch job looked gone: each try lost before starting (no
    # restart used), submitted again every 2 s, 29 of them pending in Slurm within a minute.
    job_id = queue_job(sessions)
    with sessions() as session:
        register_host(session, "host-a", "cpu", 2, {})
    for number in range(1, state.MAX_NEVER_STARTED_IN_A_ROW + 1):
        with sessions() as session:
            [(attempt_id, _)] = schedule_pass(session, settings)
            attempt = session.get(Attempt, attempt_id)
            assert attempt.number == number
            state.end_attempt(session, attempt.job, attempt, AttemptStatus.lost, reason="Slurm job ended VANISHED before the attempt started")
            session.commit()
            job = session.get(Job, job_id)
            if number < state.MAX_NEVER_STARTED_IN_A_ROW:
                assert job.status == JobStatus.queued and job.restarts == 0
    assert job.status == JobStatus.failed and job.restarts == 0
    assert f"its last {state.MAX_NEVER_STARTED_IN_A_ROW} tries all ended before starting" in job.failure_reason


def test_a_try_that_started_breaks_the_run_of_tries_that_never_did(sessions, settings):
    job_id = queue_job(sessions, max_restarts=3)
    with sessions() as session:
        register_host(session, "host-a", "cpu", 2, {})
    for number in range(1, 2 * state.MAX_NEVER_STARTED_IN_A_ROW):
        with sessions() as session:
            [(attempt_id, _)] = schedule_pass(session, settings)
            attempt = session.get(Attempt, attempt_id)
            if number % state.MAX_NEVER_STARTED_IN_A_ROW == 0:  # this one ran a while
                attempt.started_at = utcnow()
            state.end_attempt(session, attempt.job, attempt, AttemptStatus.lost, reason="host went away")
            session.commit()
            assert session.get(Job, job_id).status == JobStatus.queued, number


def test_an_unclaimed_dispatch_is_resent_after_the_timeout_and_given_back_when_its_host_goes_offline(sessions, settings):
    orphaned, stale, fresh = (queue_job(sessions) for _ in range(3))
    with sessions() as session:
        register_host(session, "host-a", "cpu", 2, {})
        register_host(session, "host-b", "cpu", 1, {})
        schedule_pass(session, settings)  # best fit: the first job on host-b, the others on host-a
        attempt = {a.job_id: a for a in session.scalars(select(Attempt))}
        assert {job: attempt[job].host_name for job in (orphaned, stale, fresh)} == {orphaned: "host-b", stale: "host-a", fresh: "host-a"}
        session.get(WorkerHost, "host-b").last_heartbeat = utcnow() - timedelta(seconds=120)
        attempt[stale].dispatched_at = utcnow() - timedelta(seconds=120)
        fresh_dispatch = attempt[fresh].dispatched_at
        session.commit()

        assert schedule_pass(session, settings) == [(attempt[stale].id, "host-a")]
        session.expire_all()
        assert attempt[orphaned].status == AttemptStatus.lost and "went offline" in attempt[orphaned].failure_reason
        job = session.get(Job, orphaned)
        assert job.status == JobStatus.queued and job.restarts == 0  # never started: no restart used
        assert attempt[stale].status == AttemptStatus.scheduled and attempt[stale].dispatched_at > utcnow() - timedelta(seconds=5)
        assert attempt[fresh].status == AttemptStatus.scheduled and attempt[fresh].dispatched_at == fresh_dispatch


def test_while_the_api_is_up_less_than_a_lease_a_lost_dispatch_is_still_resent_but_no_silent_host_is_given_up(sessions, settings):
    stale, orphaned = queue_job(sessions), queue_job(sessions)
    with sessions() as session:
        register_host(session, "host-a", "cpu", 1, {})
        register_host(session, "host-b", "cpu", 1, {})
        schedule_pass(session, settings)
        attempt = {a.job_id: a for a in session.scalars(select(Attempt))}
        assert attempt[stale].host_name != attempt[orphaned].host_name  # a slot each
        session.get(WorkerHost, attempt[orphaned].host_name).last_heartbeat = utcnow() - timedelta(seconds=120)
        attempt[stale].dispatched_at = attempt[orphaned].dispatched_at = utcnow() - timedelta(seconds=120)
        note_api_up(session, "api-1", utcnow(), beat_seconds(settings.lease_seconds))  # just (re)started
        session.commit()

        assert schedule_pass(session, settings) == [(attempt[stale].id, attempt[stale].host_name)]
        session.expire_all()
        assert attempt[orphaned].status == AttemptStatus.scheduled  # its host may only be waiting for the API


def test_two_schedulers_never_place_a_job_twice(sessions, settings):
    jobs = [queue_job(sessions) for _ in range(12)]
    with sessions() as session:
        register_host(session, "host-a", "cpu", 6, {})
        register_host(session, "host-b", "cpu", 6, {})
    results: list[list] = []
    barrier = threading.Barrier(2)

    def scheduler():
        barrier.wait()
        with sessions() as session:
            results.append(schedule_pass(session, settings))

    threads = [threading.Thread(target=scheduler) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dispatched = [attempt for result in results for attempt in result]
    assert len(dispatched) == 12
    with sessions() as session:
        attempts = session.scalars(select(Attempt)).all()
        assert sorted(a.job_id for a in attempts) == sorted(jobs)
        assert busy_slots_by_host(session) == {"host-a": 6, "host-b": 6}


def test_checkpoint_retention_keeps_the_newest(sessions, settings):
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        stale = []
        for step in (6, 12, 18):
            stale += record_checkpoint(session, job_id, claimed.attempt_id, step, f"ck/{step}", "0" * 64, 10, keep_last=2)
        assert stale == ["ck/6"]
        assert [c.step for c in list_checkpoints(session, job_id)] == [12, 18]


def test_a_new_attempt_resumes_from_the_latest_checkpoint(sessions, settings):
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    other_job_id = queue_job(sessions)
    other = place_and_claim(sessions, settings)
    with sessions() as session:
        for step in (6, 12):
            record_checkpoint(session, job_id, claimed.attempt_id, step, f"ck/{step}", "0" * 64, 10, keep_last=2)
        # Another job's newer checkpoint is not ours to resume from.
        record_checkpoint(session, other_job_id, other.attempt_id, 30, "other/30", "0" * 64, 10, keep_last=2)
        finish_attempt(session, claimed, AttemptStatus.failed, "crash")
        [(attempt_id, _)] = schedule_pass(session, settings)
        second = claim_attempt(session, attempt_id, "w2", 30)
        assert second.number == 2 and second.resume_step == 12 and second.resume_checkpoint_path == "ck/12"
        assert session.get(Job, job_id).step == 12


def queue_gang(sessions, hosts: int) -> int:
    """`hosts` one-slot CPU hosts and a queued 2-node job; returns the job's id."""
    with sessions() as session:
        for i in range(hosts):
            register_host(session, f"host-{i}", "cpu", 1, {}, address=f"10.0.0.{i}")
    return queue_job(sessions, **{"resources.nodes": 2})


def test_a_gang_gets_all_its_hosts_in_one_pass_or_none(sessions, settings):
    first = queue_gang(sessions, hosts=3)
    second = queue_job(sessions, **{"resources.nodes": 2})
    with sessions() as session:
        dispatched = schedule_pass(session, settings)
    with sessions() as session:
        attempts = session.get(Job, first).attempts
        assert [(a.number, a.node_rank) for a in attempts] == [(1, 0), (1, 1)]
        assert len({a.host_name for a in attempts}) == 2 and sorted(dispatched) == sorted((a.id, a.host_name) for a in attempts)
        # One host is left: the second gang takes nothing rather than half of what it needs.
        assert session.get(Job, second).status == JobStatus.queued and not session.get(Job, second).attempts
        assert sum(busy_slots_by_host(session).values()) == 2


def placed_gang(sessions, settings) -> tuple[int, Attempt, Attempt]:
    """A 2-node job placed on two one-slot hosts: its id and its two attempts, node 0 first."""
    job_id = queue_gang(sessions, hosts=2)
    with sessions() as session:
        schedule_pass(session, settings)
        node_0, node_1 = session.get(Job, job_id).attempts
    return job_id, node_0, node_1


def test_the_other_nodes_of_a_gang_wait_out_the_re_send_of_a_lost_dispatch_to_node_0(sessions, database_url, tmp_path):
    # Node 0's dispatch is lost; node 1 has claimed its attempt and waits for node 0's rendezvous.
    # The scheduler re-sends the dispatch nobody claimed after the dispatch timeout (1 s here), and
    # node 0's worker claims it then: node 1 must still be waiting, not have failed the gang.
    settings = Settings(data_dir=tmp_path, database_url=database_url, lease_seconds=30, host_timeout_seconds=30, dispatch_timeout_seconds=1)
    _, node_0, node_1 = placed_gang(sessions, settings)
    with sessions() as session:
        claimed_1 = claim_attempt(session, node_1.id, "w1", 30, rendezvous="10.0.0.1:1111")
    re_sent = threading.Event()

    def scheduler_and_node_0_worker():
        deadline = time.monotonic() + 10
        while not re_sent.is_set() and time.monotonic() < deadline:
            with sessions() as session:
                dispatched = schedule_pass(session, settings)
            if (node_0.id, node_0.host_name) in dispatched:
                with sessions() as session:
                    claim_attempt(session, node_0.id, "w0", 30, rendezvous="10.0.0.0:2222")
                re_sent.set()
            time.sleep(0.1)

    thread = threading.Thread(target=scheduler_and_node_0_worker)
    thread.start()
    rendezvous = AttemptRunner(settings, host_client(settings, sessions, node_1.host_name), node_1.host_name)._wait_for_gang(claimed_1).rendezvous
    thread.join()
    assert re_sent.is_set() and rendezvous == "10.0.0.0:2222"


def test_a_gangs_attempts_get_addresses_of_their_own_on_hosts_that_make_gang_networks(sessions, settings):
    # Each host that says it makes gang networks gets a /24 of the pool, kept while it is registered;
    # each attempt of a gang claimed there an address of it, its rendezvous at that address; every
    # node learns all of the gang's addresses once all have claimed (workers/gang_network.py).
    pool = "100.64.0.0/10"
    with sessions() as session:
        assert [register_host(session, f"host-{i}", "cpu", 2, {"gang_network": True}, address=f"10.0.0.{i}") for i in range(2)] == [0, 1]
        assert register_host(session, "host-1", "cpu", 2, {"gang_network": True}, address="10.0.0.1") == 1  # again: the same
        assert register_host(session, "plain", "cpu", 1, {}) is None
        deregister_host(session, "plain")
    first, second = queue_job(sessions, **{"resources.nodes": 2}), queue_job(sessions, **{"resources.nodes": 2})
    with sessions() as session:
        schedule_pass(session, settings)
        claimed = {}
        for job_id in (first, second):
            for attempt in session.get(Job, job_id).attempts:
                claimed[(job_id, attempt.node_rank)] = claim_attempt(session, attempt.id, f"w{attempt.id}", 30, f"{attempt.host_name}:29500", pool)
                if attempt.node_rank == 0 and job_id == first:
                    assert gang_rendezvous(session, claimed[(first, 0)])[1] is None  # node 1 has not claimed yet
        addresses = {key: c.net_address for key, c in claimed.items()}
        assert sorted(addresses.values()) == ["100.64.0.2", "100.64.0.3", "100.64.1.2", "100.64.1.3"]  # two gangs on two hosts
        rendezvous, gang = gang_rendezvous(session, claimed[(first, 1)])
        assert rendezvous == f"{addresses[(first, 0)]}:29500"
        assert {(node.node_rank, node.address) for node in gang} == {(0, addresses[(first, 0)]), (1, addresses[(first, 1)])}
        assert {node.host_address for node in gang} == {"10.0.0.0", "10.0.0.1"}
        # Ended, an attempt's address is free for the next gang.
        assert finish_attempt(session, claimed[(first, 0)], AttemptStatus.failed, "boom", retry=False)
        third = queue_job(sessions, **{"resources.nodes": 2})
        schedule_pass(session, settings)
        again = [claim_attempt(session, a.id, f"w{a.id}", 30, "x:1", pool) for a in session.get(Job, third).attempts]
        assert sorted(c.net_address for c in again) == sorted([addresses[(first, 0)], addresses[(first, 1)]])


def test_a_gang_runs_when_every_node_claimed_and_succeeds_when_every_node_did(sessions, settings):
    job_id, node_0, node_1 = placed_gang(sessions, settings)
    with sessions() as session:
        claimed_1 = claim_attempt(session, node_1.id, "w1", 30, rendezvous="10.0.0.1:1111")
        assert gang_rendezvous(session, claimed_1) == (None, None)  # node 0 has not started yet
        claimed_0 = claim_attempt(session, node_0.id, "w0", 30, rendezvous="10.0.0.0:2222")
        assert gang_rendezvous(session, claimed_1) == ("10.0.0.0:2222", None)  # on its hosts' network: no gang addresses
        assert session.get(Job, job_id).status == JobStatus.running
        assert finish_attempt(session, claimed_0, AttemptStatus.succeeded)
        assert session.get(Job, job_id).status == JobStatus.running  # node 1 is still finishing
        assert finish_attempt(session, claimed_1, AttemptStatus.succeeded)
        assert session.get(Job, job_id).status == JobStatus.succeeded


def test_one_lost_node_ends_its_whole_gang_and_requeues_the_job_once(sessions, settings):
    job_id, node_0, node_1 = placed_gang(sessions, settings)
    with sessions() as session:
        claimed_0 = claim_attempt(session, node_0.id, "w0", 30, rendezvous="10.0.0.0:2222")
        claimed_1 = claim_attempt(session, node_1.id, "w1", 30, rendezvous="10.0.0.1:1111")
        session.get(Attempt, node_1.id).lease_expires_at = utcnow() - timedelta(seconds=1)
        session.commit()
    with sessions() as session:
        schedule_pass(session, settings)  # reaps node 1, and places the job again on both hosts
    with sessions() as session:
        job = session.get(Job, job_id)
        first_try = [a for a in job.attempts if a.number == 1]
        assert [a.status for a in first_try] == [AttemptStatus.failed, AttemptStatus.lost]
        assert "node 1 of this gang ended lost" in first_try[0].failure_reason
        assert job.restarts == 1 and job.status == JobStatus.scheduled
        assert [(a.number, a.node_rank) for a in job.attempts if a.number == 2] == [(2, 0), (2, 1)]
        # Node 0's worker learns it through its lease, stops its processes, and can report nothing.
        assert not renew_lease(session, claimed_0, 30).held
        assert not finish_attempt(session, claimed_0, AttemptStatus.failed, "exit code 1")
        assert not finish_attempt(session, claimed_1, AttemptStatus.failed, "exit code 1")


def test_a_preempted_node_preempts_its_whole_gang_and_requeues_the_job_without_a_restart(sessions, settings):
    job_id, node_0, node_1 = placed_gang(sessions, settings)
    with sessions() as session:
        claimed_0 = claim_attempt(session, node_0.id, "w0", 30, rendezvous="10.0.0.0:2222")
        claimed_1 = claim_attempt(session, node_1.id, "w1", 30, rendezvous="10.0.0.1:1111")
        # Both nodes' ranks stopped at the same checkpoint; node 1's worker reports first.
        assert finish_attempt(session, claimed_1, AttemptStatus.preempted, "a higher-priority job needs host-1")
        assert not finish_attempt(session, claimed_0, AttemptStatus.preempted, "SIGTERM")  # already ended with its gang
        job = session.get(Job, job_id)
        assert [a.status for a in job.attempts] == [AttemptStatus.preempted, AttemptStatus.preempted]
        assert "node 1 of this gang ended preempted" in job.attempts[0].failure_reason
        assert job.status == JobStatus.queued and job.restarts == 0


def job_events(session, job_id: int) -> list[tuple[int, str, dict]]:
    return [(e.seq, e.type.value, e.data) for e in job_events_after(session, job_id, 0, limit=1000)]


def test_status_changes_metrics_and_checkpoints_are_logged_as_numbered_job_events(sessions, settings):
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        record_metrics(session, job_id, claimed.attempt_id, [(1, "train_loss", 4.0), (2, "train_loss", 3.0), (1, "lr", 0.1)])
        for _ in range(2):  # the second is a re-send of the same checkpoint: not a new event
            record_checkpoint(session, job_id, claimed.attempt_id, 2, "ck/2", "a" * 64, 10, keep_last=2)
        finish_attempt(session, claimed, AttemptStatus.succeeded)
        checkpoint_id = list_checkpoints(session, job_id)[-1].id
        assert job_events(session, job_id) == [
            (1, "status", {"status": "queued", "reason": None}),
            (2, "status", {"status": "scheduled", "reason": None}),
            (3, "status", {"status": "running", "reason": None}),
            (4, "metrics", {"step": 1, "values": {"train_loss": 4.0, "lr": 0.1}}),
            (5, "metrics", {"step": 2, "values": {"train_loss": 3.0}}),
            (6, "checkpoint", {"checkpoint_id": checkpoint_id, "step": 2, "sha256": "a" * 64, "size_bytes": 10}),
            (7, "status", {"status": "succeeded", "reason": None}),
        ]
        assert [event.seq for event in job_events_after(session, job_id, 5, limit=1)] == [6]


def test_a_transition_that_loses_the_race_logs_no_event(sessions):
    job_id = queue_job(sessions)
    with sessions() as session:
        stale = session.get(Job, job_id)  # read while still queued
        session.commit()
        with sessions() as other:
            request_cancel(other, other.get(Job, job_id))
        assert not state.move_job(session, stale, JobStatus.scheduled)
        session.commit()
        assert job_events(session, job_id) == [
            (1, "status", {"status": "queued", "reason": None}),
            (2, "status", {"status": "cancelled", "reason": "cancelled by user"}),
        ]


def test_concurrent_writers_number_a_jobs_events_without_gaps(sessions, settings):
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    barrier = threading.Barrier(2)

    def write(name: str) -> None:
        barrier.wait()
        with sessions() as session:
            for step in range(15):
                record_metrics(session, job_id, claimed.attempt_id, [(step, name, 1.0)])

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(write, "a"), pool.submit(write, "b")]:
            done.result()
    with sessions() as session:
        events = job_events(session, job_id)
        assert [seq for seq, _, _ in events] == list(range(1, 34))  # queued, scheduled, running, 30 metrics
        assert sorted((data["step"], *data["values"]) for _, kind, data in events if kind == "metrics") == sorted(
            (step, name) for step in range(15) for name in "ab"
        )
        assert session.get(Job, job_id).last_event_seq == 33


def test_migrations_build_exactly_the_tables_of_the_models(database_url):
    with session_factory(database_url)().connection() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []



def test_a_point_sent_twice_in_one_batch_is_stored_once_with_its_later_value(sessions, settings):
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    with sessions() as session:
        record_metrics(session, job_id, claimed.attempt_id, [(1, "train_loss", 4.0), (2, "lr", 0.1), (1, "train_loss", 3.9)])
        assert metric_series(session, job_id, None, None, max_points=1000) == {"lr": ([2], [0.1]), "train_loss": ([1], [3.9])}
        assert [data for _, kind, data in job_events(session, job_id) if kind == "metrics"] == [
            {"step": 1, "values": {"train_loss": 3.9}},
            {"step": 2, "values": {"lr": 0.1}},
        ]


def test_a_nan_or_infinite_metric_is_stored_as_null_and_the_rest_of_the_batch_with_it(sessions, settings):
    job_id = queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    points = [(1, "train_loss", 3.0), (2, "train_loss", float("nan")), (3, "train_loss", float("inf")), (3, "lr", 0.1)]
    with sessions() as session:
        record_metrics(session, job_id, claimed.attempt_id, points)
        series = metric_series(session, job_id, None, None, max_points=1000)
        assert series == {"lr": ([3], [0.1]), "train_loss": ([1, 2, 3], [3.0, None, None])}
        assert job_events(session, job_id)[-2:] == [
            (5, "metrics", {"step": 2, "values": {"train_loss": None}}),
            (6, "metrics", {"step": 3, "values": {"train_loss": None, "lr": 0.1}}),
        ]
        assert session.get(Job, job_id).step == 3
        # Downsampled, the divergence is still there.
        record_metrics(session, job_id, claimed.attempt_id, [(s, "train_loss", 1.0) for s in range(4, 100)])
        steps, values = metric_series(session, job_id, ["train_loss"], None, max_points=6)["train_loss"]
        assert 2 in steps and values[steps.index(2)] is None and steps[-1] == 99


def gpu_host(session, name: str, gpus: int, memory_gb: float) -> None:
    info = {"gpus": [{"index": i, "name": "H100", "memory_gb": memory_gb} for i in range(gpus)]}
    register_host(session, name, "cuda", gpus, info)


def test_jobs_sharing_a_gpu_host_get_disjoint_gpus_and_a_job_that_must_wait_says_why(sessions, settings):
    with sessions() as session:
        gpu_host(session, "big", gpus=4, memory_gb=80)
        gpu_host(session, "small", gpus=2, memory_gb=24)
    cuda = {"resources.device": "cuda", "resources.processes_per_node": 2}
    jobs = [queue_job(sessions, **cuda) for _ in range(3)]
    roomy = queue_job(sessions, **{"resources.device": "cuda", "resources.min_gpu_memory_gb": 40})
    with sessions() as session:
        schedule_pass(session, settings)
    with sessions() as session:
        placed = [(session.get(Job, j).attempts[0].host_name, session.get(Job, j).attempts[0].device_ids) for j in jobs]
        # Best fit fills the small host first, then the big one in two disjoint halves.
        assert placed == [("small", [0, 1]), ("big", [0, 1]), ("big", [2, 3])]
        waiting = session.get(Job, roomy)
        assert waiting.status == JobStatus.queued and not waiting.attempts
        assert waiting.waiting_reason == "waiting for a host with 1 free GPU of at least 40 GB; 0 hosts have that free now; big held for it"
        claimed = claim_attempt(session, session.get(Job, jobs[2]).attempts[0].id, "w", 30)
        assert claimed.device_ids == [2, 3]  # what the worker puts in CUDA_VISIBLE_DEVICES
        finish_attempt(session, claimed, AttemptStatus.succeeded)
    with sessions() as session:
        schedule_pass(session, settings)  # two of the big host's GPUs are free again
        assert session.get(Job, roomy).attempts[0].device_ids == [2] and session.get(Job, roomy).waiting_reason is None


def test_a_long_wait_outranks_a_higher_priority(sessions, settings):
    old_low = queue_job(sessions, priority=0)
    new_high = queue_job(sessions, priority=5)
    with sessions() as session:
        session.get(Job, old_low).created_at = utcnow() - timedelta(seconds=6 * settings.priority_aging_seconds)
        register_host(session, "host-a", "cpu", 1, {})
        schedule_pass(session, settings)
        assert session.get(Job, old_low).status == JobStatus.scheduled  # 0 + 6 points of waiting > 5
        assert session.get(Job, new_high).status == JobStatus.queued


def test_with_a_small_job_weight_a_one_slot_job_goes_before_an_older_eight_slot_one_until_that_has_waited_longer(sessions, settings):
    small_first = settings.model_copy(update={"small_job_weight": 10.0})  # 10 points for 1 slot, 1.25 for 8: 8.75 apart
    wide, small = queue_job(sessions, **{"resources.processes_per_node": 8}), queue_job(sessions)
    with sessions() as session:
        jobs, now = [session.get(Job, wide), session.get(Job, small)], utcnow()
        no_usage = FairShare(usage={}, quotas=Quotas(nominal={}, names={}))

        def first(settings, wide_waited: float) -> int:
            jobs[0].created_at, jobs[1].created_at = now - timedelta(seconds=wide_waited * settings.priority_aging_seconds), now
            return queue_order(jobs, now, settings, no_usage)[0].id

        assert first(small_first, 8) == small  # 8 points of waiting + 1.25 < 10
        assert first(small_first, 9) == wide  # 9 + 1.25 > 10: aging still wins in the end
        assert first(settings, 0.1) == wide  # by default size doesn't count: the older first

        # In a pass: the small one starts, and the wide one, the first that must wait, gets the host held.
        first(small_first, 8)
        register_host(session, "host-a", "cpu", 8, {})
        schedule_pass(session, small_first)
        assert session.get(Job, small).status == JobStatus.scheduled
        assert session.get(Job, wide).waiting_reason.endswith("host-a held for it")


def test_the_first_blocked_job_gets_hosts_held_and_smaller_jobs_backfill_only_elsewhere(sessions, settings):
    with sessions() as session:
        register_host(session, "wide", "cpu", 2, {})
        register_host(session, "narrow", "cpu", 1, {})
    running = [queue_job(sessions, priority=9) for _ in range(2)]
    with sessions() as session:
        schedule_pass(session, settings)  # best fit: one on "narrow", one on "wide" (1 slot left there)
        on_wide = next(j for j in running if session.get(Job, j).attempts[0].host_name == "wide")
    head = queue_job(sessions, priority=5, **{"resources.processes_per_node": 2})
    small = queue_job(sessions, priority=0)
    with sessions() as session:
        schedule_pass(session, settings)
        # The small job would fit in wide's free slot, but that would delay the head job: held.
        assert session.get(Job, head).waiting_reason.endswith("wide held for it")
        assert session.get(Job, small).status == JobStatus.queued
        register_host(session, "spare", "cpu", 1, {})
        schedule_pass(session, settings)
        assert session.get(Job, small).attempts[0].host_name == "spare"  # backfilled where no one waits
        claimed = claim_attempt(session, session.get(Job, on_wide).attempts[0].id, "w", 30)
        finish_attempt(session, claimed, AttemptStatus.succeeded)
        schedule_pass(session, settings)
        assert session.get(Job, head).attempts[0].host_name == "wide"


def test_a_higher_priority_job_preempts_only_a_lower_priority_preemptible_one(sessions, settings):
    with sessions() as session:
        register_host(session, "host-a", "cpu", 1, {})
        register_host(session, "host-b", "cpu", 1, {})
    steady = queue_job(sessions, priority=0)  # not preemptible
    spot = queue_job(sessions, priority=0, preemptible=True)
    with sessions() as session:
        schedule_pass(session, settings)
        claims = {job: claim_attempt(session, session.get(Job, job).attempts[0].id, f"w{job}", 30) for job in (steady, spot)}
    peer = queue_job(sessions, priority=0)  # same priority: waits, preempts nothing
    with sessions() as session:
        schedule_pass(session, settings)
        assert not renew_lease(session, claims[spot], 30).preempt_requested
    urgent = queue_job(sessions, priority=10)
    with sessions() as session:
        schedule_pass(session, settings)
        schedule_pass(session, settings)  # asked once; a second pass waits for it
        assert renew_lease(session, claims[spot], 30).preempt_requested
        assert not renew_lease(session, claims[steady], 30).preempt_requested
        assert "preempting lower priorities" in session.get(Job, urgent).waiting_reason
        # The worker stops it at a checkpoint: back to the queue, no restart used.
        finish_attempt(session, claims[spot], AttemptStatus.preempted, "preempted for a higher-priority job")
        schedule_pass(session, settings)
        assert session.get(Job, urgent).attempts[0].host_name == session.get(Job, spot).attempts[0].host_name
        assert session.get(Job, spot).status == JobStatus.queued and session.get(Job, spot).restarts == 0
        assert session.get(Job, peer).status == JobStatus.queued


def test_the_scheduler_is_woken_by_a_committed_submit_or_freed_devices_and_not_by_a_rolled_back_one(database_url):
    # PostgreSQL: NOTIFY in the transaction. SQLite: a datagram to the scheduler's socket after commit.
    sessions, doorbell = session_factory(database_url), Doorbell(database_url)
    doorbell.listen()
    try:
        assert not doorbell.wait(0.2)  # nothing happened

        with sessions() as session:
            user = create_user(session, "alice")[0]
            create_job(session, user, job_spec())
        assert doorbell.wait(30)

        with sessions() as session:  # a submit that never commits makes no work
            session.add(Job(owner_id=user.id, name="x", spec={}, status=JobStatus.queued, max_steps=1))
            session.flush()
            ring(session)
            session.rollback()
        assert not doorbell.wait(0.2)

        settings = Settings(database_url=database_url, lease_seconds=30)
        claimed = place_and_claim(sessions, settings)
        doorbell.wait(0.2)  # the host's registration rang
        with sessions() as session:
            finish_attempt(session, claimed, AttemptStatus.succeeded, None)
        assert doorbell.wait(30)  # the attempt's devices are free
    finally:
        doorbell.close()
    assert socket_path(database_url) is None or not Path(socket_path(database_url)).exists()  # no socket file left


def test_concurrent_submits_at_the_quota_create_exactly_the_jobs_it_allows(sessions):
    with sessions() as session:
        create_user(session, "alice")
    start = threading.Barrier(8)

    def submit(_) -> bool:
        start.wait()  # all eight at once (a session holding SQLite's write lock can't wait on the others)
        with sessions() as session:
            user = user_by_name(session, "alice")
            try:
                create_job(session, user, job_spec(), max_active=3)
                return True
            except QuotaExceeded:
                return False

    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(submit, range(8)))
    assert created.count(True) == 3
    with sessions() as session:
        assert session.query(Job).count() == 3


def test_concurrent_retries_with_one_idempotency_key_create_one_job_and_all_get_it(sessions):
    with sessions() as session:
        create_user(session, "alice")
    start = threading.Barrier(8)

    def submit(_) -> int:
        start.wait()  # all eight at once: each looks for the key before any has committed
        with sessions() as session:
            return create_job(session, user_by_name(session, "alice"), job_spec(), idempotency_key="retry-1").id

    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(submit, range(8)))
    with sessions() as session:
        assert ids == {session.scalar(select(Job.id))} and session.query(Job).count() == 1


def test_only_a_hash_of_a_token_is_stored_and_the_token_finds_its_user(sessions):
    with sessions() as session:
        user, token = create_user(session, "alice")
        stored = session.execute(select(User.token_hash).where(User.id == user.id)).scalar_one()
        everything = " ".join(str(v) for v in session.execute(select(User.__table__)).one())
        assert token not in everything and stored == hashlib.sha256(token.encode()).hexdigest()
        assert user_by_token(session, token).id == user.id and user_by_token(session, token + "x") is None


def test_log_lines_of_concurrent_writers_get_ids_in_commit_order(sessions, settings):
    job_id = queue_job(sessions, **{"resources.nodes": 2})
    with sessions() as session:
        register_host(session, "host-a", "cpu", 1, {})
        register_host(session, "host-b", "cpu", 1, {})
        node_0, node_1 = [claim_attempt(session, attempt_id, f"w{i}", 30) for i, (attempt_id, _) in enumerate(schedule_pass(session, settings))]
    first = sessions()
    lock_job_logs(first, job_id)  # node 0 is writing, not yet committed
    first.execute(LogLine.__table__.insert(), [{"job_id": job_id, "attempt_id": node_0.attempt_id, "attempt_number": 1, "seq": 0, "line": "node 0"}])
    with ThreadPoolExecutor(1) as pool:
        later = pool.submit(lambda: record_logs(sessions(), job_id, node_1, [(0, 1, "node 1")]))
        with pytest.raises(TimeoutError):
            later.result(timeout=1.0)  # node 1 waits for node 0's commit (SQLite: for its write lock)
        first.commit()
        later.result(timeout=30)
    first.close()
    with sessions() as session:
        assert [line.line for line in log_lines_after(session, job_id, 0, 10)] == ["node 0", "node 1"]


def test_a_checkpoint_is_listed_only_after_the_steps_it_covers_are_reported_even_between_reports(sessions, settings, tmp_path):
    # A resume starts after its checkpoint: a step reported only after it is listed would be lost with
    # a host killed in between. A heartbeat with no report due (the API paces reports) reports them all the same.
    queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    client = host_client(settings, sessions, "host-a")
    sent: list[str] = []
    client.http.event_hooks["request"].append(lambda request: sent.append(request.url.path.rsplit("/", 1)[-1]))
    runner = AttemptRunner(settings, client, "host-a")
    source = tmp_path / "step-10"
    (source / "state").mkdir(parents=True)
    (source / MODEL_FILE).write_bytes(b"weights")
    write_manifest(source, 10)
    outbox = Outbox(metrics=[(step, "train_loss", 1.0 / step) for step in range(1, 11)], checkpoints=Transfers([(source, 10, "step-00000010")]))

    assert runner._sync(claimed, outbox, report=False).lease.held
    assert sent == ["report", "checkpoints"] and outbox.empty()
    with sessions() as session:
        assert metric_series(session, claimed.job_id, ["train_loss"], None, 100)["train_loss"][0] == list(range(1, 11))
        assert [c.step for c in list_checkpoints(session, claimed.job_id)] == [10]
    # With nothing to list, a heartbeat with no report due renews the lease alone; what is new waits.
    outbox.metrics.append((11, "train_loss", 0.09))
    assert runner._sync(claimed, outbox, report=False).lease.held and sent[2:] == ["lease"] and outbox.metrics


def test_a_checkpoint_asks_for_a_forward_at_once_to_start_its_take_and_to_be_listed_not_while_it_is_copied():
    # Between heartbeats a paced host forwards nothing but a checkpoint: at once, whatever the pacing,
    # yet not on every round of a copy that takes minutes (each forward would be a report).
    copying, transfers = threading.Event(), Transfers([("step-10", 10, "step-00000010")])
    assert transfers.ready()  # its take is to be started
    with ThreadPoolExecutor(1) as pool:
        transfers.take_in(pool, lambda *_: copying.wait(30) and ("path", "sha", 1), OSError, timeout=0)
        assert transfers.taking is not None and not transfers.ready()  # being copied: nothing to do yet
        copying.set()
        transfers.taking.result(timeout=30)
        assert transfers.ready()  # copied: to be taken in and listed
        transfers.take_in(pool, lambda *_: None, OSError, timeout=0)
    listed = []
    transfers.record(lambda *item: listed.append(item))
    assert listed == [("step-10", 10, "step-00000010", ("path", "sha", 1))] and not transfers.ready()


def test_the_lease_is_renewed_while_a_checkpoint_is_still_being_copied_into_the_store(sessions, settings, tmp_path, monkeypatch):
    # A checkpoint on another filesystem is copied into the store and hashed: for a large one that
    # takes longer than a lease lasts, and the attempt must not be reaped as lost meanwhile.
    monkeypatch.setattr(supervisor, "INGEST_WAIT_SECONDS", 0.01)  # shorter than copying 64 MB anywhere
    queue_job(sessions)
    claimed = place_and_claim(sessions, settings)
    runner = AttemptRunner(settings, host_client(settings, sessions, "host-a"), "host-a")
    with directory_on_another_filesystem(than=tmp_path) as elsewhere:
        source = elsewhere / "step-10"
        (source / "state").mkdir(parents=True)
        (source / MODEL_FILE).write_bytes(os.urandom(64 << 20))
        write_manifest(source, 10)
        outbox = Outbox(checkpoints=Transfers([(source, 10, "step-00000010")]))
        with sessions() as session:
            renewed_before = session.get(Attempt, claimed.attempt_id).lease_expires_at
        time.sleep(0.01)

        assert runner._sync(claimed, outbox).lease.held
        assert outbox.checkpoints.items == [(source, 10, "step-00000010")] and outbox.checkpoints.taking is not None  # still being copied in
        with sessions() as session:
            assert session.get(Attempt, claimed.attempt_id).lease_expires_at > renewed_before
            assert list_checkpoints(session, claimed.job_id) == []

        deadline = time.monotonic() + 60
        while outbox.checkpoints.items and time.monotonic() < deadline:
            runner._sync(claimed, outbox)
        assert outbox.empty() and not source.exists()  # stored, then the copy's source removed
        with sessions() as session:
            stored = list_checkpoints(session, claimed.job_id)[-1]
            assert stored.step == 10 and stored.sha256 == sha256_file(runner.store.store.path(stored.path) / MODEL_FILE)
