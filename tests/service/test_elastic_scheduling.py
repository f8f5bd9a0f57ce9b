"""`resources.elastic` in the scheduler: a job that can't get its full size within `wait_s` runs on
fewer processes, and goes back to its full size at a checkpoint when that is free again. The
scheduler's passes and the workers' part are played step by step (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from api_schemas import AttemptStatus, JobSpec, JobStatus
from service.db.accounts import create_user
from service.db.attempts import claim_attempt, finish_attempt, renew_lease
from service.db.hosts import register_host
from service.db.jobs import create_job
from service.db.models import Job, utcnow
from service.db.session import session_factory
from service.scheduler import schedule_pass
from tests.helpers import job_spec, tiny_spec


def elastic(processes: int = 2, min_processes: int = 1, wait_s: float = 0, **overrides) -> JobSpec:
    """Micro-batches of 4: an optimizer step of 4 × `processes` samples."""
    return job_spec(**{
        "resources.processes_per_node": processes, "training.micro_batch_size": 4,
        "resources.elastic": {"min_processes": min_processes, "wait_s": wait_s}, **overrides,
    })


@pytest.fixture
def sessions(settings):
    return session_factory(settings.resolved_database_url)


@pytest.fixture
def owner(sessions):
    with sessions() as session:
        user, _ = create_user(session, "alice")
        register_host(session, "host-a", "cpu", 2, {})
        return user


def place(session, settings) -> list:
    """One scheduler pass, its new attempts claimed by a worker."""
    return [claim_attempt(session, attempt_id, "w1", settings.lease_seconds) for attempt_id, _ in schedule_pass(session, settings)]


def test_an_elastic_job_runs_smaller_while_part_of_its_host_is_taken_then_goes_back_to_its_full_size(sessions, settings, owner):
    with sessions() as session:
        create_job(session, owner, job_spec(name="blocker"))
        [blocking] = place(session, settings)
        job = create_job(session, owner, elastic())
        [small] = place(session, settings)
        assert (small.job_id, small.slots) == (job.id, 1)
        assert not renew_lease(session, small, settings.lease_seconds).preempt_requested

        # The other job ends: the whole host is free but for the elastic job's own process, so it is
        # asked to stop at a checkpoint, queued again without a restart, and placed at its full size.
        finish_attempt(session, blocking, AttemptStatus.succeeded)
        assert place(session, settings) == []
        assert renew_lease(session, small, settings.lease_seconds).preempt_requested
        assert finish_attempt(session, small, AttemptStatus.preempted, "stopped to go back to its full size of 2 processes")
        assert (session.get(Job, job.id).status, session.get(Job, job.id).restarts) == (JobStatus.queued, 0)
        [full] = place(session, settings)
        assert (full.job_id, full.slots, full.number) == (job.id, 2, 2)
        assert place(session, settings) == [] and not renew_lease(session, full, settings.lease_seconds).preempt_requested
        assert [a.slots for a in session.get(Job, job.id).attempts] == [1, 2]


def test_an_elastic_job_waits_wait_s_for_its_full_size_and_a_job_without_elastic_waits_for_it(sessions, settings, owner):
    with sessions() as session:
        create_job(session, owner, job_spec(name="blocker"))
        place(session, settings)
        patient = create_job(session, owner, elastic(wait_s=600))
        plain = create_job(session, owner, job_spec(name="plain", **{"resources.processes_per_node": 2}))
        assert place(session, settings) == []
        assert "; elastic: runs on as few as 1 process(es) if still queued after 600 s" in session.get(Job, patient.id).waiting_reason

        # Ten minutes later (the wait counted from when it was queued) it takes the one free process.
        session.get(Job, patient.id).created_at = utcnow() - timedelta(seconds=601)
        session.commit()
        [small] = place(session, settings)
        assert (small.job_id, small.slots) == (patient.id, 1)
        assert session.get(Job, plain.id).status == JobStatus.queued


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"resources.elastic": {"min_processes": 1}, "resources.nodes": 2}, "resources.elastic: one node only"),
        ({"resources.elastic": {"min_processes": 3}}, "resources.elastic.min_processes: at most processes_per_node (2)"),
        ({"resources.elastic": {"min_processes": 0}}, "greater than or equal to 1"),
        ({"resources.elastic": {"min_processes": 1, "wait_s": -1}}, "greater than or equal to 0"),
        # 4 processes × micro-batches of 3: 12 samples a step, which 3 processes can't share in whole micro-batches.
        ({"resources.processes_per_node": 4, "training.micro_batch_size": 3, "resources.elastic": {"min_processes": 3}},
         "resources.elastic.min_processes: an optimizer step of 12 samples"),
    ],
)
def test_an_elastic_spec_that_cannot_work_is_refused_naming_the_field(overrides, reason):
    with pytest.raises(ValidationError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        JobSpec.model_validate(tiny_spec(**{"resources.processes_per_node": 2, **overrides}))


def test_the_sizes_an_elastic_job_may_take_keep_its_optimizer_step_in_whole_micro_batches():
    spec = elastic(processes=4, min_processes=1, **{"training.micro_batch_size": 3})  # 12 samples a step
    assert spec.elastic_sizes() == [4, 2, 1]  # not 3: 3 processes take 9 samples a round, and 12 is no multiple of 9
    assert elastic(processes=2).elastic_sizes() == [2, 1] and job_spec().elastic_sizes() == [1]
    assert spec.placed_on(2).resources.processes_per_node == 2 and spec.resources.processes_per_node == 4


def test_a_script_job_cannot_be_elastic_since_it_decides_its_own_batch():
    script = {"name": "mine", "script": {"entrypoint": "train.py", "code": {"path": "project"}},
              "resources": {"processes_per_node": 2, "elastic": {"min_processes": 1}}}
    with pytest.raises(ValidationError, match="resources.elastic: a script decides its own batch"):
        JobSpec.model_validate(script)
