"""The REST API through HTTP (FastAPI's TestClient), on SQLite and the real PostgreSQL."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.api.main import create_app
from service.db import crud
from service.db.session import session_factory
from service.scheduler import schedule_pass
from service.settings import Settings
from tests.helpers import tiny_spec


@pytest.fixture
def settings(database_url, data_root, tmp_path) -> Settings:
    return Settings(data_dir=tmp_path, database_url=database_url, data_root=data_root, max_request_bytes=50_000)


@pytest.fixture
def api(settings) -> TestClient:
    return TestClient(create_app(settings))


@pytest.fixture
def tokens(settings) -> dict[str, str]:
    with session_factory(settings.resolved_database_url)() as session:
        return {
            "alice": crud.create_user(session, "alice")[1],
            "bob": crud.create_user(session, "bob")[1],
            "root": crud.create_user(session, "root", is_admin=True)[1],
        }


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_every_v1_route_needs_a_valid_token(api):
    for method, path in [("get", "/v1/jobs"), ("post", "/v1/jobs"), ("get", "/v1/jobs/1"), ("get", "/v1/dashboard"),
                         ("get", "/v1/checkpoints/1/download"), ("get", "/v1/workers")]:
        assert api.request(method, path).status_code == 401
        assert api.request(method, path, headers=auth("not-a-token")).status_code == 401
    assert api.get("/healthz").json() == {"status": "ok"}


def test_submit_returns_a_queued_job(api, tokens):
    response = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"]))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "queued" and job["owner"] == "alice" and job["step"] == 0
    assert job["max_steps"] == 12 and job["effective_batch_size"] == 4


def test_other_users_get_404_for_a_job_and_everything_under_it(api, tokens):
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    for path in ["", "/metrics", "/logs", "/checkpoints"]:
        assert api.get(f"/v1/jobs/{job_id}{path}", headers=auth(tokens["bob"])).status_code == 404
        assert api.get(f"/v1/jobs/{job_id}{path}", headers=auth(tokens["alice"])).status_code == 200
        assert api.get(f"/v1/jobs/{job_id}{path}", headers=auth(tokens["root"])).status_code == 200
    assert api.post(f"/v1/jobs/{job_id}/cancel", headers=auth(tokens["bob"])).status_code == 404
    assert api.get("/v1/jobs", headers=auth(tokens["bob"])).json()["items"] == []
    assert api.get("/v1/dashboard", headers=auth(tokens["bob"])).json()["jobs_by_status"]["queued"] == 0


@pytest.mark.parametrize(
    ("overrides", "loc", "reason"),
    [
        ({"model.n_embd": 33}, ["body", "model"], "divisible by n_head"),
        ({"training.max_steps": -1}, ["body", "training", "max_steps"], "greater than or equal to 1"),
        ({"dataset.path": "missing.txt"}, ["body", "dataset", "path"], "no dataset file"),
        ({"dataset.path": "../../etc/passwd"}, ["body", "dataset", "path"], "'..'"),
        ({"training.precision": "fp16"}, ["body"], "fp16 needs device 'cuda'"),
    ],
)
def test_bad_specs_get_422_naming_the_field(api, tokens, overrides, loc, reason):
    response = api.post("/v1/jobs", json=tiny_spec(**overrides), headers=auth(tokens["alice"]))
    assert response.status_code == 422
    assert any(error["loc"][: len(loc)] == loc and reason in error["msg"] for error in response.json()["detail"]), response.json()


def test_a_symlink_out_of_the_data_root_is_refused(api, tokens, data_root, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    (data_root / "link.txt").symlink_to(outside)
    response = api.post("/v1/jobs", json=tiny_spec(**{"dataset.path": "link.txt"}), headers=auth(tokens["alice"]))
    assert response.status_code == 422 and "outside the data root" in response.text


def test_oversized_bodies_get_413(api, tokens):
    response = api.post("/v1/jobs", content=b"{" + b" " * 60_000 + b"}", headers={**auth(tokens["alice"]), "Content-Type": "application/json"})
    assert response.status_code == 413


def test_idempotency_key_makes_retries_create_one_job(api, tokens):
    headers = {**auth(tokens["alice"]), "Idempotency-Key": "retry-1"}
    first = api.post("/v1/jobs", json=tiny_spec(), headers=headers).json()
    second = api.post("/v1/jobs", json=tiny_spec(), headers=headers).json()
    assert first["id"] == second["id"]
    assert len(api.get("/v1/jobs", headers=auth(tokens["alice"])).json()["items"]) == 1


def api_with_quota(settings: Settings, max_active_jobs: int) -> TestClient:
    return TestClient(create_app(settings.model_copy(update={"max_active_jobs_per_user": max_active_jobs})))


def test_a_submit_over_the_active_job_quota_gets_429_until_one_of_the_users_jobs_ends(settings, tokens):
    api = api_with_quota(settings, 3)
    alice = auth(tokens["alice"])
    ids = [api.post("/v1/jobs", json=tiny_spec(), headers=alice).json()["id"] for _ in range(3)]
    # Placed and running jobs count as much as queued ones: one running, one scheduled, one queued.
    sessions = session_factory(settings.resolved_database_url)
    with sessions() as session:
        crud.register_host(session, "host-a", "cpu", 2, {})
        (attempt_id, _), _ = schedule_pass(session, settings)
    with sessions() as session:
        assert crud.claim_attempt(session, attempt_id, "worker-1", settings.lease_seconds) is not None
    assert sorted(api.get(f"/v1/jobs/{i}", headers=alice).json()["status"] for i in ids) == ["queued", "running", "scheduled"]

    refused = api.post("/v1/jobs", json=tiny_spec(), headers=alice)
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "60"
    detail = refused.json()["detail"]
    assert detail["limit"] == 3 and detail["active"] == 3 and "the limit is 3" in detail["msg"]

    assert api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["bob"])).status_code == 201  # per user
    api.post(f"/v1/jobs/{ids[-1]}/cancel", headers=alice)  # the queued one: cancelled at once, no longer active
    assert api.post("/v1/jobs", json=tiny_spec(), headers=alice).status_code == 201


def test_an_idempotent_retry_at_the_quota_returns_the_job_it_created(settings, tokens):
    api = api_with_quota(settings, 1)
    headers = {**auth(tokens["alice"]), "Idempotency-Key": "submit-1"}
    created = api.post("/v1/jobs", json=tiny_spec(), headers=headers)
    retried = api.post("/v1/jobs", json=tiny_spec(), headers=headers)
    assert retried.status_code == 201 and retried.json()["id"] == created.json()["id"]
    assert api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).status_code == 429  # a new job is still refused


def test_job_list_pages_with_a_cursor_and_filters_by_status(api, tokens):
    ids = [api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"] for _ in range(5)]
    api.post(f"/v1/jobs/{ids[0]}/cancel", headers=auth(tokens["alice"]))
    seen, cursor = [], None
    while True:
        page = api.get("/v1/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}, headers=auth(tokens["alice"])).json()
        seen += [job["id"] for job in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(ids, reverse=True)
    cancelled = api.get("/v1/jobs", params={"status": "cancelled"}, headers=auth(tokens["alice"])).json()["items"]
    assert [job["id"] for job in cancelled] == [ids[0]]
    assert api.get("/v1/jobs", params={"status": "bogus"}, headers=auth(tokens["alice"])).status_code == 422


def test_cancelling_a_queued_job_is_immediate(api, tokens):
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    job = api.post(f"/v1/jobs/{job_id}/cancel", headers=auth(tokens["alice"])).json()
    assert job["status"] == "cancelled" and job["finished_at"] is not None


def test_unknown_job_and_checkpoint_are_404(api, tokens):
    assert api.get("/v1/jobs/999999", headers=auth(tokens["alice"])).status_code == 404
    assert api.get("/v1/checkpoints/999999/download", headers=auth(tokens["alice"])).status_code == 404
