"""Teams' quotas in a cluster pool (service/fair_share.py, SQLite and PostgreSQL): a quota of
`slurm/cpu` slots governs the jobs a team hands to the Slurm pool. Within it they are handed over
at once (Slurm queues them if the partition is full); beyond it a team borrows only what the pool
has idle, and what it borrowed is taken back at a checkpoint when another team's job within its
quota is handed to a full pool; never below a team's own quota. (The scheduler alone, no Slurm:
the pool as its backend last described it.)"""

from __future__ import annotations

import pytest

from api_schemas import AttemptStatus, JobStatus
from service.db.accounts import create_user
from service.db.attempts import finish_attempt, renew_lease
from service.db.models import Attempt, Job
from service.db.pools import record_pool
from service.db.session import session_factory
from service.db.teams import add_member, create_team
from tests.service.test_teams import place, submit


@pytest.fixture
def settings_overrides() -> dict:
    return {"fair_share_update_seconds": 0, "slurm_partition": "batch"}


def asked_to_stop(session, settings, running) -> list:
    return [held for held in running if renew_lease(session, held, settings.lease_seconds).preempt_requested]


def test_a_pool_quota_hands_over_within_it_borrows_what_is_idle_and_reclaims_it_at_a_checkpoint(settings):
    with session_factory(settings.resolved_database_url)() as session:
        alice, _ = create_user(session, "alice")
        bob, _ = create_user(session, "bob")
        record_pool(session, "slurm", "slurm", {"partition": "batch", "nodes": 2, "cpus_per_node": 2, "gpus_per_node": 0, "memory_mb": 2000})
        vision, nlp = create_team(session, "vision", {"slurm/cpu": 2}), create_team(session, "nlp", {"slurm/cpu": 2})
        add_member(session, vision, alice, default=True)
        add_member(session, nlp, bob, default=True)
        session.commit()
        in_pool = {"resources.pool": "slurm"}

        # Alice's team: 2 slots its own, 2 borrowed while the pool's other 2 are idle; the rest wait.
        submit(session, settings, alice, 6, **in_pool)
        running = place(session, settings)
        assert len(running) == 4 and {session.get(Attempt, held.attempt_id).pool for held in running} == {"slurm"}
        waiting = session.query(Job).filter(Job.status == JobStatus.queued).first()
        assert waiting.waiting_reason == (
            "team vision at its quota: 4 of 2 slurm/cpu slots in use, 2 borrowed; it borrows idle slots of pool slurm beyond it: 0 of its 4 slots idle"
        )

        # Bob's job, within nlp's quota, is handed to the full pool: the newest borrowing try is
        # asked to stop at its checkpoint, and only that one (the next pass counts it as going).
        [bobs] = submit(session, settings, bob, 1, **in_pool)
        [handed] = place(session, settings)
        assert handed.job_id == bobs.id
        [asked] = asked_to_stop(session, settings, running)
        assert asked.attempt_id == max(held.attempt_id for held in running)
        assert renew_lease(session, asked, settings.lease_seconds).preempt_reason == "reclaimed for a team's quota of slurm/cpu"
        assert place(session, settings) == [] and asked_to_stop(session, settings, running) == [asked]

        # Stopped at a checkpoint: queued again with no restart counted, and it waits (the pool is full).
        finish_attempt(session, asked, AttemptStatus.preempted, "reclaimed; stopped at a checkpoint")
        reclaimed = session.get(Job, asked.job_id)
        assert (reclaimed.status, reclaimed.restarts) == (JobStatus.queued, 0)
        assert place(session, settings) == []
        running = [held for held in running if held is not asked] + [handed]

        # Bob's second job takes back the other borrowed slot; a third, beyond nlp's quota, stops
        # nothing whatever its priority: vision is then at its quota.
        submit(session, settings, bob, 1, **in_pool)
        running += place(session, settings)
        [asked] = asked_to_stop(session, settings, running)
        assert session.get(Job, asked.job_id).spec["team"] == "vision"
        finish_attempt(session, asked, AttemptStatus.preempted, "reclaimed; stopped at a checkpoint")
        running.remove(asked)
        [third] = submit(session, settings, bob, 1, priority=1000, preemptible=True, **in_pool)
        assert place(session, settings) == [] and asked_to_stop(session, settings, running) == []
        session.refresh(third)
        assert third.waiting_reason.startswith("team nlp at its quota: 2 of 2 slurm/cpu slots in use")
