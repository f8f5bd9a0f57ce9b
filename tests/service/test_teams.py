"""Teams in the scheduler (service/fair_share.py): a team within its quota gets its slots back from a
team that borrowed them, at a checkpoint and with no restart counted; a team at its quota is never
preempted for another's job; two users of one team converge to equal device-hours. The scheduler's
passes and the workers' part are played step by step, the clock moved by time-machine (SQLite and
PostgreSQL). The API and CLI's part: admins only, audited, a clear error for a team not yours."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from api_schemas import AttemptStatus, JobStatus
from service.admission import Refused, admit
from service.db.accounts import create_user
from service.db.attempts import claim_attempt, finish_attempt, renew_lease
from service.db.hosts import record_heartbeat, register_host
from service.db.models import Job, utcnow
from service.db.pools import record_pool
from service.db.session import session_factory
from service.db.teams import add_member, create_team, default_team
from service.scheduler import schedule_pass
from tests.helpers import job_spec


@pytest.fixture
def settings_overrides() -> dict:
    return {"fair_share_update_seconds": 0}


@pytest.fixture
def sessions(settings):
    return session_factory(settings.resolved_database_url)


def place(session, settings) -> list:
    """One scheduler pass, its new attempts claimed by a worker."""
    return [claim_attempt(session, attempt_id, "w1", settings.lease_seconds) for attempt_id, _ in schedule_pass(session, settings)]


def submit(session, settings, user, n: int = 1, **overrides) -> list[Job]:
    return [admit(session, session, user, job_spec(name=f"{user.name}-{i}", **overrides), settings) for i in range(n)]


def team_of_jobs(session, claimed) -> list[str]:
    return sorted(session.get(Job, held.job_id).spec["team"] for held in claimed)


def test_a_team_under_its_quota_reclaims_borrowed_slots_at_a_checkpoint_and_never_below_the_lenders_quota(sessions, settings):
    with sessions() as session:
        alice, _ = create_user(session, "alice")
        bob, _ = create_user(session, "bob")
        register_host(session, "host-a", "cpu", 4, {})
        vision, nlp = create_team(session, "vision", {"cpu": 2}), create_team(session, "nlp", {"cpu": 2})
        add_member(session, vision, alice, default=False)
        add_member(session, nlp, bob, default=False)
        session.commit()

        # Alice's team fills the host: 2 slots its own, 2 borrowed while nobody else wants them.
        submit(session, settings, alice, 10)
        running = place(session, settings)
        assert len(running) == 4 and team_of_jobs(session, running) == ["vision"] * 4
        waiting = session.query(Job).filter(Job.status == JobStatus.queued).first()
        assert waiting.waiting_reason.startswith("team vision at its quota: 4 of 2 CPU slots in use, 2 borrowed; it borrows idle slots beyond it")

        # Bob's team, under its quota, wants a slot: the newest borrowed attempt is asked to stop.
        [bobs] = submit(session, settings, bob)
        assert place(session, settings) == []
        session.refresh(bobs)
        assert "1 slot borrowed by team vision reclaimed at their next checkpoint" in bobs.waiting_reason
        asked = [held for held in running if renew_lease(session, held, settings.lease_seconds).preempt_requested]
        assert [held.attempt_id for held in asked] == [max(held.attempt_id for held in running)]
        lease = renew_lease(session, asked[0], settings.lease_seconds)
        assert lease.preempt_reason == f"reclaimed for team nlp's quota (job {bobs.id})"

        # It stops at a checkpoint: queued again with no restart counted; the slot goes to bob's job.
        finish_attempt(session, asked[0], AttemptStatus.preempted, lease.preempt_reason + "; stopped at a checkpoint")
        reclaimed = session.get(Job, asked[0].job_id)
        assert (reclaimed.status, reclaimed.restarts) == (JobStatus.queued, 0)
        [started] = place(session, settings)
        assert started.job_id == bobs.id
        running = [held for held in running if held is not asked[0]] + [started]

        # A second job of bob's takes back the other borrowed slot; a third (beyond nlp's quota)
        # stops nothing: vision is at its quota, whatever the priority.
        submit(session, settings, bob, 1, priority=100)
        place(session, settings)
        asked = [held for held in running if renew_lease(session, held, settings.lease_seconds).preempt_requested]
        assert len(asked) == 1 and session.get(Job, asked[0].job_id).spec["team"] == "vision"
        finish_attempt(session, asked[0], AttemptStatus.preempted, "reclaimed; stopped at a checkpoint")
        running = [held for held in running if held is not asked[0]] + place(session, settings)
        assert team_of_jobs(session, running) == ["nlp", "nlp", "vision", "vision"]

        [third] = submit(session, settings, bob, 1, priority=1000, preemptible=True)
        assert place(session, settings) == []
        assert not [held for held in running if renew_lease(session, held, settings.lease_seconds).preempt_requested]
        session.refresh(third)
        assert third.waiting_reason.startswith("team nlp at its quota: 2 of 2 CPU slots in use; it borrows idle slots beyond it")


def two_teams_of_one_slot_each(session) -> tuple:
    """Alice in team vision, bob in nlp, each team's quota 1 of host-a's 2 CPU slots."""
    alice, _ = create_user(session, "alice")
    bob, _ = create_user(session, "bob")
    register_host(session, "host-a", "cpu", 2, {})
    add_member(session, create_team(session, "vision", {"cpu": 1}), alice, default=True)
    add_member(session, create_team(session, "nlp", {"cpu": 1}), bob, default=True)
    session.commit()
    return alice, bob


def test_a_higher_priority_of_another_team_never_preempts_a_job_within_its_teams_quota(sessions, settings):
    with sessions() as session:
        alice, bob = two_teams_of_one_slot_each(session)
        submit(session, settings, alice, 1, preemptible=True)
        [alices] = place(session, settings)
        submit(session, settings, bob, 1, preemptible=True)
        [bobs] = place(session, settings)
        # Bob's urgent job is beyond nlp's quota: alice's job, within vision's, is not its to stop;
        # bob's own lower-priority preemptible job is.
        submit(session, settings, bob, 1, priority=500)
        place(session, settings)
        assert not renew_lease(session, alices, settings.lease_seconds).preempt_requested
        assert not renew_lease(session, bobs, settings.lease_seconds).preempt_requested  # it borrows: it waits for idle room


def test_a_job_wider_than_its_teams_quota_borrowed_as_a_whole_and_is_reclaimed(sessions, settings):
    with sessions() as session:
        alice, bob = two_teams_of_one_slot_each(session)
        # Vision's 2-process job holds its 1 slot and 1 borrowed: a team could otherwise hold
        # another's quota for a whole job by asking for one slot more than its own.
        submit(session, settings, alice, 1, **{"resources.processes_per_node": 2})
        [wide] = place(session, settings)
        [bobs] = submit(session, settings, bob)
        assert place(session, settings) == []
        session.refresh(bobs)
        assert "2 slots borrowed by team vision reclaimed at their next checkpoint" in bobs.waiting_reason
        assert renew_lease(session, wide, settings.lease_seconds).preempt_requested
        finish_attempt(session, wide, AttemptStatus.preempted, "reclaimed; stopped at a checkpoint")
        [started] = place(session, settings)
        assert started.job_id == bobs.id


def test_two_users_of_one_team_converge_to_equal_device_hours(sessions, settings):
    """One slot, two users who keep jobs of an hour each waiting; alice queued ten before bob's first."""
    with sessions() as session, time_machine.travel(utcnow(), tick=False) as clock:
        alice, _ = create_user(session, "alice")
        bob, _ = create_user(session, "bob")
        register_host(session, "host-a", "cpu", 1, {})
        team = create_team(session, "lab", {})
        add_member(session, team, alice, default=True)
        add_member(session, team, bob, default=True)
        session.commit()
        submit(session, settings, alice, 10)
        clock.shift(timedelta(seconds=30))
        submit(session, settings, bob, 10)
        hours = {"alice": 0, "bob": 0}
        for _ in range(12):
            [held] = place(session, settings)
            hours[session.get(Job, held.job_id).owner.name] += 1
            clock.shift(timedelta(hours=1))
            record_heartbeat(session, "host-a")
            renew_lease(session, held, settings.lease_seconds)
            finish_attempt(session, held, AttemptStatus.succeeded)
        # First come first served would have given alice all twelve hours but two.
        assert abs(hours["alice"] - hours["bob"]) <= 0.1 * 12, hours


def test_a_job_names_one_of_its_owners_teams_or_runs_under_their_default(sessions, settings):
    with sessions() as session:
        alice, _ = create_user(session, "alice")
        register_host(session, "host-a", "cpu", 2, {})
        session.commit()
        [untouched] = submit(session, settings, alice)
        assert untouched.team_id is None and untouched.spec["team"] is None  # nobody configured teams: as before
        vision, nlp = create_team(session, "vision", {"cpu": 1}), create_team(session, "nlp", {})
        add_member(session, vision, alice, default=False)  # her first team: her default
        add_member(session, nlp, alice, default=False)
        session.commit()
        [job] = submit(session, settings, alice)
        assert (job.team_id, job.spec["team"]) == (vision.id, "vision")
        [job] = submit(session, settings, alice, team="nlp")
        assert job.team_id == nlp.id
        with pytest.raises(Refused) as refused:
            submit(session, settings, alice, team="robotics")
        assert refused.value.field == ("team",) and refused.value.message == "no team named 'robotics'; your teams: nlp, vision"

        # `trainyard team add nlp alice --default`, said again and again: nlp stays her default.
        for _ in range(3):
            add_member(session, nlp, alice, default=True)
            session.commit()
            assert default_team(session, alice) is nlp


def test_teams_through_the_api_admins_only_audited_and_shown_with_what_they_hold(api, sessions, settings):
    with sessions() as session:
        _, admin = create_user(session, "root", is_admin=True)
        alice, token = create_user(session, "alice")
        register_host(session, "host-a", "cpu", 4, {})
        session.commit()
    as_admin, as_alice = {"Authorization": f"Bearer {admin}"}, {"Authorization": f"Bearer {token}"}

    assert api.post("/v1/teams", json={"name": "vision", "quota": {"cpu": 2}}, headers=as_alice).status_code == 403
    assert api.post("/v1/teams", json={"name": "vision", "quota": {"cpu": 2}}, headers=as_admin).status_code == 201
    assert api.post("/v1/teams", json={"name": "vision"}, headers=as_admin).status_code == 409
    refused = api.post("/v1/teams", json={"name": "Vision"}, headers=as_admin)  # to people, one name
    assert refused.status_code == 409 and "a team named 'vision' exists" in refused.text
    refused = api.post("/v1/teams", json={"name": "nlp", "quota": {"tpu": 2}}, headers=as_admin)
    assert refused.status_code == 422 and "quota" in refused.text
    for bad in (-3, True, "2", 1.5):
        refused = api.post("/v1/teams", json={"name": "nlp", "quota": {"cpu": bad}}, headers=as_admin)
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "quota", "cpu"], bad
    # A pool's slots: of a pool the scheduler has described, or a quota nobody could ever use.
    refused = api.post("/v1/teams", json={"name": "nlp", "quota": {"slrum/cuda": 4}}, headers=as_admin)
    assert refused.status_code == 422 and refused.json()["detail"][0] == {
        "loc": ["body", "quota", "slrum/cuda"], "msg": "no pool named 'slrum' (pools: none; GET /v1/pools)", "type": "value_error",
    }
    with sessions() as session:
        record_pool(session, "slurm", "slurm", {"partition": "gpu", "nodes": 2})
        session.commit()
    assert api.put("/v1/teams/vision/quota", json={"quota": {"cpu": 2, "slrum/cuda": 4}}, headers=as_admin).status_code == 422
    assert api.put("/v1/teams/vision/quota", json={"quota": {"cpu": 2, "slurm/cuda": 4}}, headers=as_admin).json()["quota"] == {
        "cpu": 2, "slurm/cuda": 4,
    }
    assert api.put("/v1/teams/vision/quota", json={"quota": {"cpu": 2}}, headers=as_admin).status_code == 200
    refused = api.post("/v1/teams/vision/members", json={"user": "nobody"}, headers=as_admin)
    assert refused.status_code == 422 and refused.json()["detail"][0] == {"loc": ["body", "user"], "msg": "no user named 'nobody'", "type": "value_error"}
    assert api.post("/v1/teams/vision/members", json={"user": "alice"}, headers=as_admin).json()["members"] == ["alice*"]

    spec = job_spec(name="mine").model_dump(mode="json")
    for _ in range(3):
        assert api.post("/v1/jobs", json=spec, headers=as_alice).json()["spec"]["team"] == "vision"
    refused = api.post("/v1/jobs", json={**spec, "team": "nlp"}, headers=as_alice)
    [error] = refused.json()["detail"]
    assert refused.status_code == 422 and error["loc"] == ["body", "team"] and "your teams: vision" in error["msg"]
    with sessions() as session:
        place(session, settings)
    [vision] = api.get("/v1/teams", headers=as_alice).json()
    assert (vision["quota"], vision["in_use"], vision["borrowed"], vision["waiting_jobs"]) == ({"cpu": 2}, {"cpu": 3}, {"cpu": 1}, 0)

    # Usage counts per team too (the attempts ran no time yet at this clock: three jobs, none of another team).
    assert [(t["team"], t["jobs"]) for t in api.get("/v1/usage", headers=as_admin).json()["teams"]] == [("vision", 3)]

    assert api.put("/v1/teams/vision/quota", json={"quota": {"cpu": 4}}, headers=as_admin).json()["borrowed"] == {}
    assert api.delete("/v1/teams/vision/members/alice", headers=as_admin).json()["members"] == []
    trail = [entry["detail"] for entry in api.get("/v1/audit", headers=as_admin).json()["items"]]
    assert {"created team vision with quota {'cpu': 2}", "added alice to team vision", "removed alice from team vision"} <= set(trail)
