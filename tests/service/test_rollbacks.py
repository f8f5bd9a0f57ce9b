"""The loss guard's rollback in the service (SQLite and PostgreSQL): an attempt that ends with a
rollback drops the job's checkpoints from the spike on, queues the job with no restart counted,
and its next attempt resumes from the checkpoint before the spike, told to skip the spike's
batches until it checkpoints past them; past training.guard.max_rollbacks the job fails saying why."""

from __future__ import annotations

from api_schemas import AttemptStatus, JobEventType, JobStatus
from api_schemas.host_api import Rollback
from service.db.accounts import create_user
from service.db.attempts import claim_attempt, finish_attempt
from service.db.checkpoints import list_checkpoints, record_checkpoint
from service.db.jobs import create_job
from service.db.models import Attempt, Job, JobEvent
from service.db.session import session_factory
from service.scheduler import schedule_pass
from tests.helpers import job_spec
from service.db.hosts import register_host


def run_attempt(session, settings):
    [(attempt_id, _)] = schedule_pass(session, settings)
    return claim_attempt(session, attempt_id, "w1", settings.lease_seconds)


def test_a_rollback_resumes_before_the_spike_past_its_batches_and_too_many_fail_the_job(settings):
    sessions = session_factory(settings.resolved_database_url)
    with sessions() as session:
        owner, _ = create_user(session, "alice")
        register_host(session, "host-a", "cpu", 1, {})
        job = create_job(session, owner, job_spec(**{"training.max_steps": 100, "training.guard": {"max_rollbacks": 1}}))
        first = run_attempt(session, settings)
        for step in (10, 20, 30):
            record_checkpoint(session, job.id, first.attempt_id, step, f"ck/{step}", "0" * 64, 10, keep_last=5)
        dropped: list[str] = []
        spike = Rollback(first_step=25, last_step=27, reason="train_loss above 3 × its median")
        assert finish_attempt(session, first, AttemptStatus.preempted, "loss guard", rollback=spike, dropped=dropped)
        assert dropped == ["ck/30"] and [c.step for c in list_checkpoints(session, job.id)] == [10, 20]
        job = session.get(Job, job.id)
        assert (job.status, job.restarts, job.rollbacks) == (JobStatus.queued, 0, 1)
        [event] = session.query(JobEvent).filter(JobEvent.job_id == job.id, JobEvent.type == JobEventType.rollback).all()
        assert event.data["resume_step"] == 20 and (event.data["first_step"], event.data["last_step"]) == (25, 27)

        # The next attempt resumes at 20, skipping the batches of steps 21-27; and so would another,
        # until a checkpoint past 20 holds the position after the skip.
        second = run_attempt(session, settings)
        assert (second.resume_step, second.skip_steps) == (20, 7)
        record_checkpoint(session, job.id, second.attempt_id, 30, "ck/30b", "0" * 64, 10, keep_last=5)
        session.refresh(job)
        assert job.rollback_skip is None

        # A second spike, past max_rollbacks 1: the job fails, saying why.
        assert finish_attempt(session, second, AttemptStatus.preempted, "loss guard", rollback=Rollback(first_step=40, last_step=40, reason="train_loss nan at step 40"))
        session.refresh(job)
        assert (job.status, job.rollbacks, job.restarts) == (JobStatus.failed, 1, 0)  # what was rolled back: once
        assert "loss guard; not rolled back again, after 1 rollback (training.guard.max_rollbacks)" in job.failure_reason
        assert session.get(Attempt, second.attempt_id).status == AttemptStatus.failed


def test_a_watched_loops_rollback_drops_the_checkpoints_it_names_and_skips_nothing(settings):
    # A script's checkpoints are numbered its own way (epochs 1-4 here, its metrics' steps 1-40):
    # the worker names those written after the spike began; no batches are skipped (that is the script's).
    sessions = session_factory(settings.resolved_database_url)
    with sessions() as session:
        owner, _ = create_user(session, "alice")
        register_host(session, "host-a", "cpu", 1, {})
        job = create_job(session, owner, job_spec())
        first = run_attempt(session, settings)
        for epoch in (1, 2, 3, 4):
            record_checkpoint(session, job.id, first.attempt_id, epoch, f"ck/epoch_{epoch}", "0" * 64, 10, keep_last=5)
        dropped: list[str] = []
        spike = Rollback(first_step=40, last_step=40, reason="loss nan at step 40", drop=["ck/epoch_4", "ck/never-registered"])
        assert finish_attempt(session, first, AttemptStatus.preempted, "loss guard", rollback=spike, dropped=dropped)
        assert dropped == ["ck/epoch_4"] and [c.step for c in list_checkpoints(session, job.id)] == [1, 2, 3]
        job = session.get(Job, job.id)
        assert (job.status, job.rollbacks) == (JobStatus.queued, 1)
        queued = session.query(JobEvent).filter(JobEvent.job_id == job.id, JobEvent.type == JobEventType.status).all()[-1]
        assert "resuming from step 3, through its own resume" in queued.data["reason"]
        second = run_attempt(session, settings)
        assert (second.resume_step, second.resume_checkpoint_path, second.skip_steps) == (3, "ck/epoch_3", 0)
