"""Teams on a running stack: a team under its quota gets the slot another team borrowed back at the
borrower's next checkpoint, and the borrowing job, queued again with no restart counted, resumes
there and ends with the weights of its team's job that was never stopped (workers, real training)."""

from __future__ import annotations

import httpx
import pytest

from service.db.accounts import create_user
from service.db.session import session_factory
from common.settings import Settings
from stack.embedded import ADMIN_NAME, embedded_stack
from tests.e2e.test_end_to_end import wait_for
from tests.e2e.test_faults import FAULT_SPEC, assert_same_run, final_weights, wait_until_training
from tests.helpers import small_spec
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)
ENDED = {"succeeded", "failed", "cancelled"}


def test_a_team_under_its_quota_takes_back_a_borrowed_slot_and_the_borrower_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")  # how often a worker looks at its lease (5 s in production)
    with embedded_stack(tmp_path / "yard", free_port(), workers=1, devices="cpu:2") as info:
        with session_factory(Settings(data_dir=info.data_dir).resolved_database_url)() as session:
            _, bob_token = create_user(session, "bob")
        admin = httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30)
        bob = httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {bob_token}"}, timeout=30)
        for team, member in (("vision", ADMIN_NAME), ("nlp", "bob")):
            assert admin.post("/v1/teams", json={"name": team, "quota": {"cpu": 1}}).status_code == 201
            assert admin.post(f"/v1/teams/{team}/members", json={"user": member}).status_code == 200

        # Vision's two jobs take both slots: one its own, one borrowed (the newer attempt).
        own_id, borrowing_id = (admin.post("/v1/jobs", json=FAULT_SPEC).json()["id"] for _ in range(2))
        wait_until_training(admin, borrowing_id)
        [vision] = [t for t in admin.get("/v1/teams").json() if t["name"] == "vision"]
        assert (vision["in_use"], vision["borrowed"]) == ({"cpu": 2}, {"cpu": 1})

        # NLP, under its quota, wants its slot: the borrowed one is given back at a checkpoint.
        short = small_spec(**{"name": "nlp-job", "training.max_steps": 20, "schedule.warmup_steps": 2})
        nlp_id = bob.post("/v1/jobs", json=short).json()["id"]
        nlp_job = wait_for(bob, nlp_id, ENDED, timeout=240)
        assert nlp_job["status"] == "succeeded", nlp_job["failure_reason"]

        own = wait_for(admin, own_id, ENDED, timeout=240)
        borrowing = wait_for(admin, borrowing_id, ENDED, timeout=240)
        assert own["status"] == borrowing["status"] == "succeeded", (own["failure_reason"], borrowing["failure_reason"])
        assert len(own["attempts"]) == 1  # within vision's quota: never stopped
        first, second = borrowing["attempts"]
        assert first["status"] == "preempted" and borrowing["restarts"] == 0
        assert f"reclaimed for team nlp's quota (job {nlp_id})" in first["failure_reason"]
        # NLP's job started on a slot given back: the borrowed one, or vision's own if that job ended
        # first (it may, a few steps from its end): never a third process on two slots.
        assert min(first["finished_at"], own["finished_at"]) <= nlp_job["attempts"][0]["started_at"]
        # It resumed where it stopped and ended as the job that ran straight through.
        series = admin.get(f"/v1/jobs/{own_id}/metrics", params={"names": "train_loss,eval_loss"}).json()["series"]
        assert_same_run(admin, borrowing_id, (series, final_weights(admin, own_id)), FAULT_SPEC["training"]["max_steps"])
        admin.close()
        bob.close()
