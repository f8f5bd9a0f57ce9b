"""A script's checkpoints and its job's status in the database (SQLite and PostgreSQL): every
stored folder its own checkpoint, kept and resumed in the order saved; a job that succeeds on a
retry shows no failure."""

from __future__ import annotations

from api_schemas import AttemptStatus, JobEventType, JobStatus
from service.db.attempts import claim_attempt, finish_attempt
from service.db.checkpoints import list_checkpoints, record_checkpoint, record_refused
from service.db.jobs import job_events_after
from service.db.models import Job
from service.db.session import session_factory
from service.scheduler import schedule_pass
from tests.helpers import start_job
from tests.service.test_data_layer import queue_job
from workers.supervisor import final_state


def test_two_folders_with_one_step_are_two_checkpoints_and_retention_counts_them_in_save_order(settings):
    sessions = session_factory(settings.resolved_database_url)
    claimed = start_job(settings, queue_job(sessions))
    saved = [(1000, "a1.1/step_1000"), (1200, "a1.2/step_1200"), (1200, "a1.3/step_1200"), (3, "a1.4/epoch_3")]
    with sessions() as session:
        stale = []
        for step, path in saved:
            stale += record_checkpoint(session, claimed.job_id, claimed.attempt_id, step, path, "0" * 64, 10, keep_last=3)
        record_checkpoint(session, claimed.job_id, claimed.attempt_id, 3, "a1.4/epoch_3", "0" * 64, 10, keep_last=3)  # a re-send
        kept = list_checkpoints(session, claimed.job_id)
    assert [(c.step, c.path) for c in kept] == saved[1:]  # the epoch folder is the newest, whatever its number
    assert stale == ["a1.1/step_1000"]


def test_a_new_attempt_resumes_from_the_newest_saved_checkpoint_not_the_highest_step(settings):
    sessions = session_factory(settings.resolved_database_url)
    job_id = queue_job(sessions, max_restarts=1)
    claimed = start_job(settings, job_id)
    with sessions() as session:
        record_checkpoint(session, job_id, claimed.attempt_id, 1200, "a1.1/step_1200", "0" * 64, 10, keep_last=5)
        record_checkpoint(session, job_id, claimed.attempt_id, 2, "a1.2/epoch_2", "0" * 64, 10, keep_last=5)
        finish_attempt(session, claimed, AttemptStatus.failed, "killed")
    with sessions() as session:
        [(attempt_id, _)] = schedule_pass(session, settings)
    with sessions() as session:
        second = claim_attempt(session, attempt_id, "w1", settings.lease_seconds)
    assert (second.resume_checkpoint_path, second.resume_step) == ("a1.2/epoch_2", 2)


def test_a_job_that_succeeds_on_a_retry_has_no_failure_reason_and_its_attempts_keep_theirs(settings):
    sessions = session_factory(settings.resolved_database_url)
    job_id = queue_job(sessions, max_restarts=1)
    with sessions() as session:
        finish_attempt(session, start_job(settings, job_id), AttemptStatus.failed, "exit 1")
    with sessions() as session:
        assert session.get(Job, job_id).failure_reason.startswith("retrying after attempt 1")
        [(attempt_id, _)] = schedule_pass(session, settings)
    with sessions() as session:
        finish_attempt(session, claim_attempt(session, attempt_id, "w1", settings.lease_seconds), AttemptStatus.succeeded)
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job.status == JobStatus.succeeded and job.failure_reason is None
        assert [(a.status, a.failure_reason) for a in sorted(job.attempts, key=lambda a: a.number)] == [
            (AttemptStatus.failed, "exit 1"), (AttemptStatus.succeeded, None),
        ]


def test_a_progress_bar_line_keeps_only_what_a_terminal_would_show_last():
    assert final_state(" 10%|#  | 1/10\r 50%|#####  | 5/10\r100%|#########| 10/10") == "100%|#########| 10/10"
    assert final_state("done 100%\r") == "done 100%"  # a bar that ends with its carriage return
    assert final_state("plain line") == "plain line"


def test_a_refused_checkpoint_is_an_event_of_the_job_and_resumes_nothing(settings):
    sessions = session_factory(settings.resolved_database_url)
    claimed = start_job(settings, queue_job(sessions))
    with sessions() as session:
        record_refused(session, claimed.job_id, JobEventType.checkpoint_refused, 50, "a1.1/step_50", "unreadable manifest")
        events = job_events_after(session, claimed.job_id, 0, 100)
        assert list_checkpoints(session, claimed.job_id) == []
    refused = [(event.type, event.data) for event in events if event.type is not JobEventType.status]
    assert refused == [(JobEventType.checkpoint_refused, {"step": 50, "what": "a1.1/step_50", "reason": "unreadable manifest"})]
