"""The REST API through HTTP (FastAPI's TestClient), on SQLite and the real PostgreSQL."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api_schemas import AttemptStatus, JobStatus
from api_schemas.host_api import HOST_API_PREFIX

from service.api.main import create_app
from service.db.accounts import create_user, user_by_name
from service.db.attempts import claim_attempt, finish_attempt
from service.db.checkpoints import list_checkpoints, record_checkpoint
from service.db.host_tokens import issue_host_token
from service.db.hosts import register_host
from service.db.jobs import create_job, request_cancel
from service.db.log_lines import record_logs
from service.db.metrics import record_metrics
from service.db.models import Job, WorkerHost, utcnow
from service.db.scheduling import place_jobs
from service.db.scheduler_processes import note_scheduler_pass
from service.db.session import session_factory
from service.scheduler import schedule_pass
from common.settings import Settings
from tests.helpers import auth, classifier_spec, finish_job, job_spec, start_job, tiny_spec, write_labelled_jsonl


@pytest.fixture
def settings_overrides() -> dict:
    return {"max_request_bytes": 50_000}


@pytest.fixture
def tokens(settings) -> dict[str, str]:
    with session_factory(settings.resolved_database_url)() as session:
        return {
            "alice": create_user(session, "alice")[1],
            "bob": create_user(session, "bob")[1],
            "root": create_user(session, "root", is_admin=True)[1],
        }


def test_every_v1_route_needs_a_valid_token(settings):
    # Every route the app documents, read from the app itself: a route added later is covered too.
    # A wrong token per route: more than the failed-auth limit allows one address in a minute.
    api = TestClient(create_app(settings.model_copy(update={"max_failed_auths_per_minute": 1000})))
    paths = api.app.openapi()["paths"]
    routes = [(method, path) for path, operations in paths.items() if path.startswith("/v1/") for method in operations]
    assert len(routes) >= 15
    routes.remove(("post", "/v1/login"))  # the one open route: it takes a one-time code instead (test_browser_login.py)
    for method, template in routes:
        path = re.sub(r"\{[^}]+\}", "1", template)
        assert api.request(method, path).status_code == 401, (method, template)
        assert api.request(method, path, headers=auth("not-a-token")).status_code == 401, (method, template)
    assert api.get("/healthz").json() == {"status": "ok"}
    # The server's address opened in a browser: the page, which asks for a sign-in itself (was "Not Found").
    home = api.get("/", follow_redirects=False)
    assert home.status_code == 307 and home.headers["location"] == "/dashboard"
    assert api.get("/").headers["content-type"].startswith("text/html")


def test_the_api_docs_pages_load_everything_from_the_api_itself(api):
    # A GPU cluster behind an air gap reaches no CDN: /docs and /redoc were blank pages there.
    for page in ("/docs", "/redoc"):
        html = api.get(page).text
        assert "openapi.json" in html and "cdn." not in html and "https://" not in html.replace("https://fastapi.tiangolo.com", ""), page
        assets = re.findall(r'(?:src|href)="(/[^"]+\.(?:js|css|png))"', html)
        assert assets, page
        for asset in assets:
            assert api.get(asset).status_code == 200, asset

def test_submit_returns_a_queued_job(api, tokens):
    response = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"]))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "queued" and job["owner"] == "alice" and job["step"] == 0
    assert job["max_steps"] == 12 and job["effective_batch_size"] == 4


def test_other_users_get_404_for_a_job_and_everything_under_it(api, tokens):
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    for path in ["", "/metrics", "/logs", "/checkpoints", "/events?follow=false"]:
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
        ({"dataset.tokenizer_file": "absent.json"}, ["body", "dataset", "tokenizer_file"], "no file 'absent.json' under the data root"),
        ({"dataset.tokenizer_file": "../tokenizer.json"}, ["body", "dataset", "tokenizer_file"], "'..'"),
        # Tiny Shakespeare's 1.1 MB, 10% held out, make 15,685 windows of 64: a batch of 20,000 could never be filled (it failed 4 attempts).
        ({"training.micro_batch_size": 20000, "model.block_size": 64, "dataset.val_fraction": 0.1}, ["body", "training", "micro_batch_size"],
         "at most 15,685 windows of 64"),
        ({"training.micro_batch_size": 4000, "training.gradient_accumulation_steps": 4, "model.block_size": 64, "dataset.val_fraction": 0.1},
         ["body", "training", "micro_batch_size"], "one optimizer step of 16,000"),
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
    # The key sent again with another spec: refused, not answered with the first job as if it were this one.
    reused = api.post("/v1/jobs", json=tiny_spec(name="another"), headers=headers)
    assert reused.status_code == 422, reused.text
    assert reused.json()["detail"] == f"this Idempotency-Key was used for job {first['id']}, with another spec: a retry sends the same spec, a new job a new key"
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
        register_host(session, "host-a", "cpu", 2, {})
        (attempt_id, _), _ = schedule_pass(session, settings)
    with sessions() as session:
        assert claim_attempt(session, attempt_id, "worker-1", settings.lease_seconds) is not None
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


def test_job_list_searches_names_and_owners_in_any_case_taking_wildcards_literally(api, tokens):
    def submit(user: str, name: str) -> int:
        return api.post("/v1/jobs", json=tiny_spec(name=name), headers=auth(tokens[user])).json()["id"]

    alpha, under, plain, bobs = submit("alice", "Alpha-run"), submit("alice", "lr_0.1"), submit("alice", "lr-0.1"), submit("bob", "alpha-too")

    def found(user: str, q: str) -> list[int]:
        answer = api.get("/v1/jobs", params={"q": q}, headers=auth(tokens[user]))
        assert answer.status_code == 200, answer.text
        return [job["id"] for job in answer.json()["items"]]

    assert found("alice", "ALPHA") == [alpha]  # bob's job is not alice's to see
    assert found("root", "alpha") == [bobs, alpha]
    assert found("alice", "lr_") == [under] and found("alice", "%") == []  # _ and % are text, not wildcards
    assert found("root", "BoB") == [bobs]  # the owner's name
    assert api.get("/v1/jobs", params={"q": "x" * 101}, headers=auth(tokens["alice"])).status_code == 422
    assert plain in found("alice", "")


def test_cancelling_a_queued_job_is_immediate(api, tokens):
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    job = api.post(f"/v1/jobs/{job_id}/cancel", headers=auth(tokens["alice"])).json()
    assert job["status"] == "cancelled" and job["finished_at"] is not None


def test_unknown_job_and_checkpoint_are_404(api, tokens):
    assert api.get("/v1/jobs/999999", headers=auth(tokens["alice"])).status_code == 404
    assert api.get("/v1/checkpoints/999999/download", headers=auth(tokens["alice"])).status_code == 404


def test_a_checkpoint_larger_than_one_read_downloads_whole_and_by_range(api, tokens, settings):
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    claimed = start_job(settings, job_id)
    model = os.urandom(5 * 2**19 + 123)  # 2.5 MiB and a bit: several of the route's 1 MiB reads
    directory = settings.resolved_artifact_root / "ck" / "12"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(model)
    with session_factory(settings.resolved_database_url)() as session:
        record_checkpoint(session, job_id, claimed.attempt_id, 12, "ck/12", "0" * 64, len(model), keep_last=2)
        checkpoint_id = list_checkpoints(session, job_id)[-1].id
    url = f"/v1/checkpoints/{checkpoint_id}/download"
    assert api.get(url, headers=auth(tokens["alice"])).content == model
    span = api.get(url, headers={**auth(tokens["alice"]), "Range": f"bytes={2**20 - 10}-{2**21 + 9}"})
    assert span.status_code == 206 and span.content == model[2**20 - 10 : 2**21 + 10]


def test_a_checkpoint_deleted_by_keep_last_answers_a_404_that_says_so_and_names_the_kept_ones(api, tokens, settings):
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    claimed = start_job(settings, job_id)
    with session_factory(settings.resolved_database_url)() as session:
        for step in (6, 12, 18):
            record_checkpoint(session, job_id, claimed.attempt_id, step, f"ck/{step}", "0" * 64, 10, keep_last=2)
        kept = list_checkpoints(session, job_id)
    deleted_id = kept[0].id - 1
    answer = api.get(f"/v1/checkpoints/{deleted_id}/download", headers=auth(tokens["alice"]))
    assert answer.status_code == 404
    assert answer.json()["detail"] == (
        f"checkpoint {deleted_id} (step 6 of job {job_id}) was deleted by the job's checkpoint.keep_last retention; "
        f"kept: {kept[0].id} (step 12), {kept[1].id} (step 18)"
    )
    # Someone else learns nothing about it; an id never used is a plain 404.
    assert api.get(f"/v1/checkpoints/{deleted_id}/download", headers=auth(tokens["bob"])).json()["detail"] == "checkpoint not found"
    assert api.get("/v1/checkpoints/999999/download", headers=auth(tokens["alice"])).json()["detail"] == "checkpoint not found"


def test_a_running_job_shows_its_last_loss_rate_and_eta(api, tokens, settings):
    job_id = api.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 100}), headers=auth(tokens["alice"])).json()["id"]
    other_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    sessions = session_factory(settings.resolved_database_url)
    with sessions() as session:
        register_host(session, "host-a", "cpu", 1, {})
        [(attempt_id, _)] = schedule_pass(session, settings)
        claimed = claim_attempt(session, attempt_id, "w1", settings.lease_seconds)
        # Out of step order on purpose: "last" means the highest step, not the newest row.
        record_metrics(session, job_id, claimed.attempt_id, [(40, "train_loss", 2.5), (40, "step_time_s", 0.5)])
        record_metrics(session, job_id, claimed.attempt_id, [(39, "train_loss", 9.0), (39, "step_time_s", 9.0)])

    for job in [api.get(f"/v1/jobs/{job_id}", headers=auth(tokens["alice"])).json(),
                api.get("/v1/jobs", headers=auth(tokens["alice"])).json()["items"][1]]:
        assert job["status"] == "running" and job["step"] == 40
        assert job["last_train_loss"] == 2.5 and job["steps_per_second"] == 2.0
        assert job["eta_seconds"] == pytest.approx(60 * 0.5)  # 60 steps left at 0.5 s each
    queued = api.get(f"/v1/jobs/{other_id}", headers=auth(tokens["alice"])).json()
    assert queued["last_train_loss"] is None and queued["eta_seconds"] is None
    with sessions() as session:  # cancelled: its last loss stays, its speed and ETA go
        request_cancel(session, session.get(Job, job_id))
        finish_attempt(session, claimed, AttemptStatus.cancelled, "cancelled by user")
    cancelled = api.get(f"/v1/jobs/{job_id}", headers=auth(tokens["alice"])).json()
    assert cancelled["status"] == "cancelled" and cancelled["last_train_loss"] == 2.5
    assert cancelled["steps_per_second"] is None and cancelled["eta_seconds"] is None


def prometheus_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, its labels): value} of a Prometheus text exposition, parsed by the reference parser."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_endpoint_reports_the_whole_service_from_the_database(api, tokens, settings):
    sessions = session_factory(settings.resolved_database_url)
    with sessions() as session:
        alice, bob = user_by_name(session, "alice"), user_by_name(session, "bob")
        running, finished = create_job(session, alice, job_spec()), create_job(session, bob, job_spec())
        create_job(session, alice, job_spec())
        create_job(session, bob, job_spec())
        request_cancel(session, create_job(session, bob, job_spec()))
        register_host(session, "host-a", "cpu", 2, {})
        register_host(session, "host-b", "cpu", 2, {})
        claimed = {}
        for job in (running, finished):
            attempt_id = place_jobs(session, [(job, [("host-a", None)], 1)], utcnow())[0].id
            session.commit()
            claimed[job] = claim_attempt(session, attempt_id, "w1", settings.lease_seconds)
        finish_attempt(session, claimed[finished], AttemptStatus.succeeded)
        # Known waits: queued 20 s and 400 s; claimed 0.3 s and 3 s after placement.
        for job, queued_for, unclaimed_for in ((running, 20, 0.3), (finished, 400, 3.0)):
            job.created_at = job.started_at - timedelta(seconds=queued_for)
            job.attempts[0].created_at = job.attempts[0].started_at - timedelta(seconds=unclaimed_for)
        session.get(WorkerHost, "host-b").last_heartbeat = utcnow() - timedelta(seconds=120)
        session.commit()
        record_metrics(session, running.id, running.attempts[0].id, [(1, "train_loss", 4.0), (1, "lr", 0.1), (2, "train_loss", 3.0)])
        for step, size in ((6, 1000), (12, 2500)):
            record_checkpoint(session, running.id, running.attempts[0].id, step, f"ck/{step}", "0" * 64, size, keep_last=2)

    response = api.get("/metrics")  # no token: Prometheus scrapes unauthenticated
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert "alice" not in response.text and "bob" not in response.text
    samples = prometheus_samples(response.text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    assert {status: value("trainyard_jobs", status=status) for status in JobStatus} == {
        JobStatus.queued: 2, JobStatus.scheduled: 0, JobStatus.running: 1,
        JobStatus.succeeded: 1, JobStatus.failed: 0, JobStatus.cancelled: 1, JobStatus.pruned: 0,
    }
    assert value("trainyard_attempts_running") == 1
    wait = "trainyard_job_queue_wait_seconds"
    assert [value(f"{wait}_bucket", le=le) for le in ("15.0", "30.0", "300.0", "900.0", "+Inf")] == [0, 1, 1, 2, 2]
    # Durations are computed by the database: SQLite's julianday() keeps milliseconds.
    assert value(f"{wait}_count") == 2 and value(f"{wait}_sum") == pytest.approx(420, abs=1e-3)
    dispatch = "trainyard_attempt_dispatch_latency_seconds"
    assert [value(f"{dispatch}_bucket", le=le) for le in ("0.25", "0.5", "2.5", "5.0", "+Inf")] == [0, 1, 1, 2, 2]
    assert value(f"{dispatch}_sum") == pytest.approx(3.3, abs=1e-3)
    assert value("trainyard_metric_points_total") == 3
    assert value("trainyard_checkpoint_bytes") == 3500
    assert value("trainyard_worker_host_up", host="host-a") == 1 and value("trainyard_worker_host_up", host="host-b") == 0
    assert value("trainyard_worker_host_heartbeat_age_seconds", host="host-a") < 60
    assert 120 <= value("trainyard_worker_host_heartbeat_age_seconds", host="host-b") < 180


def sse_messages(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """Server-Sent Events as {field: value} per message; a comment line (a heartbeat) as {"comment": text}."""
    message: dict[str, str] = {}
    for line in lines:
        if line.startswith(":"):
            yield {"comment": line[1:].strip()}
        elif line:
            field, _, value = line.partition(":")
            message[field] = value.removeprefix(" ")
        elif message:
            yield message
            message = {}


def read_events(api, token: str, job_id: int, last_event_id: int | None = None) -> list[dict[str, str]]:
    """One read of the events there are now (follow=false)."""
    headers = {**auth(token), **({"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {})}
    response = api.get(f"/v1/jobs/{job_id}/events", params={"follow": "false"}, headers=headers)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"), response.text
    return list(sse_messages(response.text.splitlines()))


END = {"event": "end", "data": "{}"}


def test_job_events_resume_after_last_event_id_with_no_gaps_or_duplicates(api, tokens, settings):
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    claimed = start_job(settings, job_id)
    with session_factory(settings.resolved_database_url)() as session:
        record_metrics(session, job_id, claimed.attempt_id, [(1, "train_loss", 4.0), (1, "lr", 0.1)])

    first = read_events(api, tokens["alice"], job_id)  # the job is running: no `end` yet
    assert [m["id"] for m in first] == ["1", "2", "3", "4"]
    finish_job(settings, claimed)
    second = read_events(api, tokens["alice"], job_id, last_event_id=4)
    assert [m.get("id") for m in second] == ["5", "6", "7", None] and second[-1] == END

    everything = read_events(api, tokens["alice"], job_id)
    assert first + second == everything
    events = [json.loads(m["data"]) for m in everything[:-1]]
    assert [m["event"] for m in everything[:-1]] == [e["type"] for e in events]
    assert [(e["id"], e["type"], e["data"].get("status") or e["data"].get("step")) for e in events] == [
        (1, "status", "queued"), (2, "status", "scheduled"), (3, "status", "running"), (4, "metrics", 1),
        (5, "checkpoint", 12), (6, "metrics", 12), (7, "status", "succeeded"),
    ]
    for after in range(len(everything)):
        assert read_events(api, tokens["alice"], job_id, last_event_id=after) == everything[after:]
    assert read_events(api, tokens["alice"], job_id, last_event_id=10**6) == [END]
    response = api.get(f"/v1/jobs/{job_id}/events", headers={**auth(tokens["alice"]), "Last-Event-ID": "x"})
    assert response.status_code == 422


@pytest.mark.timeout(60)
def test_a_followed_event_stream_sends_heartbeats_then_each_event_as_it_commits_and_ends_with_the_job(tokens, settings):
    fast = TestClient(create_app(settings.model_copy(update={"events_poll_seconds": 0.05, "events_heartbeat_seconds": 0.2})))
    job_id = fast.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    received = []
    with fast.stream("GET", f"/v1/jobs/{job_id}/events", headers=auth(tokens["alice"])) as response:
        for message in sse_messages(response.iter_lines()):
            received.append(message.get("event") or message["comment"])
            if received == ["status", "keep-alive"]:  # idle and kept alive: now the job runs, while we listen
                finish_job(settings, start_job(settings, job_id))
    assert [m for m in received if m != "keep-alive"] == ["status", "status", "status", "checkpoint", "metrics", "status", "end"]


def test_followed_logs_stream_the_tail_then_each_new_line_of_the_rank_asked_for_and_end_with_the_job(tokens, settings):
    fast = TestClient(create_app(settings.model_copy(update={"events_poll_seconds": 0.05, "events_heartbeat_seconds": 0.2})))
    job_id = fast.post("/v1/jobs", json=tiny_spec(**{"resources.processes_per_node": 2}), headers=auth(tokens["alice"])).json()["id"]
    claimed = start_job(settings, job_id, slots=2)
    sessions = session_factory(settings.resolved_database_url)
    with sessions() as session:  # ranks 0 and 1 interleaved, then a launcher line (no rank)
        record_logs(session, job_id, claimed, [(i, i % 2, f"line {i}") for i in range(6)] + [(6, None, "launcher")])

    received: list[dict] = []
    params = {"follow": "true", "tail": 2, "rank": 1}
    with fast.stream("GET", f"/v1/jobs/{job_id}/logs", params=params, headers=auth(tokens["alice"])) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for message in sse_messages(response.iter_lines()):
            received.append(message)
            if message.get("comment") == "keep-alive" and len(received) == 3:  # caught up: the job prints more, then ends
                with sessions() as session:
                    record_logs(session, job_id, claimed, [(7, 1, "line 7"), (8, 0, "line 8"), (9, 1, "line 9")])
                finish_job(settings, claimed)
    lines = [json.loads(m["data"])["line"] for m in received if m.get("event") == "line"]
    assert lines == ["line 3", "line 5", "line 7", "line 9"] and received[-1] == END

    # Resuming after a cut: the lines after the last id received, as a cursor or Last-Event-ID.
    ids = [m["id"] for m in received if m.get("event") == "line"]
    for resume in ({"cursor": ids[1]}, {}):
        headers = {**auth(tokens["alice"]), **({} if resume else {"Last-Event-ID": ids[1]})}
        response = fast.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true", "rank": 1, **resume}, headers=headers)
        again = list(sse_messages(response.text.splitlines()))
        assert [json.loads(m["data"])["line"] for m in again[:-1]] == ["line 7", "line 9"] and again[-1] == END

    # A rank the job doesn't have is a mistake to say so, not an empty log.
    response = fast.get(f"/v1/jobs/{job_id}/logs", params={"rank": 2}, headers=auth(tokens["alice"]))
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "rank"], response.text
    assert "the job runs 2 processes: ranks 0–1" in response.text


def test_a_job_no_registered_host_could_ever_run_is_refused_naming_resources(api, tokens, settings):
    cuda_job = tiny_spec(**{"resources.device": "cuda"})
    # No host registered yet: hosts may still join, so the job is accepted and waits.
    queued = api.post("/v1/jobs", json=cuda_job, headers=auth(tokens["alice"])).json()
    with session_factory(settings.resolved_database_url)() as session:
        schedule_pass(session, settings)
        assert session.get(Job, queued["id"]).waiting_reason.startswith("waiting for a worker host: none is online")  # not "0 free"
        register_host(session, "cpu-box", "cpu", 2, {})
        schedule_pass(session, settings)
    assert api.get(f"/v1/jobs/{queued['id']}", headers=auth(tokens["alice"])).json()["waiting_reason"] == (
        "waiting for a host with 1 free GPU; 0 hosts have that free now"
    )
    response = api.post("/v1/jobs", json=cuda_job, headers=auth(tokens["alice"]))
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "resources"] and "cpu-box (2 cpu)" in error["msg"]
    gang = tiny_spec(**{"resources.nodes": 2})
    assert api.post("/v1/jobs", json=gang, headers=auth(tokens["alice"])).status_code == 422  # one host, two nodes
    assert api.post("/v1/jobs", json=tiny_spec(**{"resources.processes_per_node": 2}), headers=auth(tokens["alice"])).status_code == 201


def test_workers_show_their_gpus_and_what_runs_on_them_naming_only_your_own_jobs(api, tokens, settings):
    cuda_job = tiny_spec(**{"resources.device": "cuda", "resources.processes_per_node": 2})
    gpus = [{"index": i, "name": "H100", "memory_gb": 79.6} for i in range(4)]
    with session_factory(settings.resolved_database_url)() as session:
        register_host(session, "gpu-1", "cuda", 4, {"gpus": gpus}, address="10.1.2.3")
    job_id = api.post("/v1/jobs", json=cuda_job, headers=auth(tokens["alice"])).json()["id"]
    with session_factory(settings.resolved_database_url)() as session:
        schedule_pass(session, settings)

    def worker_as(user: str) -> dict:
        [worker] = api.get("/v1/workers", headers=auth(tokens[user])).json()
        return worker

    alice_view = worker_as("alice")
    assert alice_view["address"] == "10.1.2.3" and alice_view["gpus"] == gpus and alice_view["busy_slots"] == 2
    assert alice_view["attempts"] == [{"job_id": job_id, "node_rank": 0, "slots": 2, "gpus": [0, 1], "status": "scheduled"}]
    assert worker_as("bob")["attempts"][0]["job_id"] is None and worker_as("bob")["attempts"][0]["gpus"] == [0, 1]
    assert worker_as("root")["attempts"][0]["job_id"] == job_id


@pytest.mark.parametrize(
    ("content", "overrides", "reason"),
    [
        ('{"text": "abc", "label": "a"}\n{"text": "def"}\n', {}, "line 2 has no 'label'"),
        ('{"body": "abc", "label": "a"}\n', {}, "line 1 has no 'text'"),
        ("not json\n", {}, "line 1 is not JSON"),
        ('{"text": "abc", "label": "a"}\n{"text": "d", "label": "b"}\n', {"model.num_labels": 3}, "holds 2 distinct labels (a, b) but model.num_labels is 3"),
        ("text,category\nabc,a\n", {"dataset.kind": "csv"}, "no column 'label' in the CSV header"),
        ("", {}, "is empty"),
        ("text,label\ncaf\xe9,0\nhi,1\n".encode("latin-1"), {"dataset.kind": "csv"}, "is not UTF-8 text: save it as UTF-8"),  # was a 500
    ],
    ids=["missing-label", "missing-text", "not-json", "label-count", "csv-column", "empty", "latin-1"],
)
def test_a_labelled_dataset_the_classifier_cannot_use_gets_422_naming_the_problem(api, tokens, data_root, content, overrides, reason):
    (data_root / "labels.jsonl").write_bytes(content if isinstance(content, bytes) else content.encode())
    spec = classifier_spec(**{"model.num_labels": 2, **overrides})
    response = api.post("/v1/jobs", json=spec, headers=auth(tokens["alice"]))
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "dataset", "path"] and reason in error["msg"]


def test_a_classifier_spec_names_its_fields_without_the_union_tag(api, tokens, data_root):
    write_labelled_jsonl(data_root / "labels.jsonl")
    assert api.post("/v1/jobs", json=classifier_spec(), headers=auth(tokens["alice"])).status_code == 201
    bad = classifier_spec(**{"model.num_labels": 1, "dataset.text_column": ""})
    locs = {tuple(error["loc"]) for error in api.post("/v1/jobs", json=bad, headers=auth(tokens["alice"])).json()["detail"]}
    assert locs == {("body", "model", "num_labels"), ("body", "dataset", "text_column")}
    mismatched = classifier_spec(**{"dataset": {"kind": "text", "path": "tinyshakespeare.txt"}})
    [error] = api.post("/v1/jobs", json=mismatched, headers=auth(tokens["alice"])).json()["detail"]
    assert "a classifier (`mlp`, an `hf` …ForSequenceClassification) on `jsonl`, `csv` or `hf_disk`" in error["msg"]


@pytest.mark.parametrize(
    ("model", "loc", "reason"),
    [
        ({"architecture": "ResNetForImageClassification"}, ["body", "model", "architecture"], "'DistilBertForSequenceClassification'"),
        ({"config": {"vocab_size": 99}}, ["body", "model", "config"], "vocab_size: set by the engine"),
        ({"num_labels": None}, ["body", "model"], "needs num_labels"),
        ({"path": "models/absent"}, ["body", "model", "path"], "no directory 'models/absent' with a config.json"),
        ({"path": "../models"}, ["body", "model", "path"], "'..'"),
    ],
    ids=["unknown-architecture", "engine-key", "no-num-labels", "missing-directory", "outside-root"],
)
def test_an_hf_model_spec_the_engine_cannot_build_gets_422_naming_the_field(api, tokens, data_root, model, loc, reason):
    write_labelled_jsonl(data_root / "labels.jsonl")
    hf = {"kind": "hf", "architecture": "DistilBertForSequenceClassification", "num_labels": 3, "config": {"dim": 32, "n_heads": 2}}
    assert api.post("/v1/jobs", json=classifier_spec(model=hf), headers=auth(tokens["alice"])).status_code == 201
    response = api.post("/v1/jobs", json=classifier_spec(model={**hf, **model}), headers=auth(tokens["alice"]))
    assert response.status_code == 422, response.text
    assert any(error["loc"][: len(loc)] == loc and reason in error["msg"] for error in response.json()["detail"]), response.json()


def test_a_custom_job_needs_its_entrypoint_module_in_the_plugin_directory_and_no_dataset(api, tokens, settings, tmp_path):
    plugins = settings.resolved_plugin_dir
    plugins.mkdir()
    (plugins / "gan_example.py").write_text("def train(ctx):\n    pass\n")
    (tmp_path / "outside.py").write_text("def train(ctx):\n    pass\n")
    (plugins / "linked.py").symlink_to(tmp_path / "outside.py")
    spec = {**tiny_spec(), "model": {"kind": "custom", "entrypoint": "gan_example:train", "config": {"hidden": 8}}}
    del spec["dataset"]
    response = api.post("/v1/jobs", json=spec, headers=auth(tokens["alice"]))
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["model"]["config"] == {"hidden": 8}

    for entrypoint, reason in [
        ("absent:train", "no module absent.py in the plugin directory"),
        ("linked:train", "no module linked.py in the plugin directory"),  # a symlink out of it
        ("os.path:join", "String should match pattern"),
        ("../outside:train", "String should match pattern"),
    ]:
        response = api.post("/v1/jobs", json={**spec, "model": {**spec["model"], "entrypoint": entrypoint}}, headers=auth(tokens["alice"]))
        assert response.status_code == 422, response.text
        [error] = response.json()["detail"]
        assert error["loc"] == ["body", "model", "entrypoint"] and reason in error["msg"], error

    gpt_without_data = {**tiny_spec()}
    del gpt_without_data["dataset"]
    [error] = api.post("/v1/jobs", json=gpt_without_data, headers=auth(tokens["alice"])).json()["detail"]
    assert "dataset: required, except for a `custom` model" in error["msg"]


@pytest.mark.parametrize(
    ("dataset", "overrides", "reason"),
    [
        ({"text_column": "body"}, {}, "no column 'body' among ['text', 'label']"),
        ({}, {"model.num_labels": 3}, "holds 2 distinct labels (neg, pos) but model.num_labels is 3"),
        ({"split": None}, {}, "holds the splits ['test', 'train']: dataset.split must name one of them"),
        ({"path": "absent"}, {}, "no dataset directory 'absent' under the data root"),
        ({"path": "tinyshakespeare.txt"}, {}, "no dataset directory 'tinyshakespeare.txt'"),
    ],
    ids=["missing-column", "label-count", "no-split", "missing-directory", "a-file"],
)
def test_a_saved_dataset_the_model_cannot_use_gets_422_naming_the_problem(api, tokens, data_root, dataset, overrides, reason):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    split = datasets.Dataset.from_dict({"text": ["good", "bad", "fine"], "label": ["pos", "neg", "pos"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(data_root / "reviews"))
    base = {"kind": "hf_disk", "path": "reviews", "split": "train"}
    assert api.post("/v1/jobs", json=classifier_spec(dataset=base, **{"model.num_labels": 2}), headers=auth(tokens["alice"])).status_code == 201
    spec = classifier_spec(dataset={**base, **dataset}, **{"model.num_labels": 2, **overrides})
    response = api.post("/v1/jobs", json=spec, headers=auth(tokens["alice"]))
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "dataset", "path"] and reason in error["msg"], error


def test_wrong_tokens_past_the_limit_get_429_with_retry_after_from_that_address_only_and_right_ones_are_served(settings, tokens):
    app = create_app(settings.model_copy(update={"max_failed_auths_per_minute": 3}))
    api, other = TestClient(app), TestClient(app, client=("10.0.0.2", 50000))
    for _ in range(3):
        assert api.get("/v1/jobs", headers=auth("ty_wrong")).status_code == 401
    refused = api.get("/v1/jobs", headers=auth("ty_wrong"))
    assert refused.status_code == 429 and 0 < int(refused.headers["Retry-After"]) <= 60
    assert api.get("/v1/jobs").status_code == 429
    assert api.post(f"{HOST_API_PREFIX}/heartbeat", headers=auth("tyh_wrong")).status_code == 429
    # A right token from that address is served: on the embedded stack every client is 127.0.0.1, and a
    # user's loop with a mistyped token had the worker hosts' reports refused, their attempts lost.
    assert api.get("/v1/jobs", headers=auth(tokens["alice"])).status_code == 200
    with session_factory(settings.resolved_database_url)() as session:
        host_token = issue_host_token(session, "node-1")
    assert api.post(f"{HOST_API_PREFIX}/register", headers=auth(host_token), json={"device": "cpu", "slots": 1, "address": "127.0.0.1"}).status_code == 200
    assert api.post(f"{HOST_API_PREFIX}/heartbeat", headers=auth(host_token)).status_code == 204
    assert other.get("/v1/jobs", headers=auth("ty_wrong")).status_code == 401  # another address's are its own


def test_a_stream_past_the_per_user_cap_gets_429(settings, tokens):
    api = TestClient(create_app(settings.model_copy(update={"max_streams_per_user": 1, "events_poll_seconds": 0.05})))
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    with api.stream("GET", f"/v1/jobs/{job_id}/events", headers=auth(tokens["alice"])) as first:
        lines = first.iter_lines()
        next(lines)
        assert api.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"}, headers=auth(tokens["alice"])).status_code == 429
        finish_job(settings, start_job(settings, job_id))
        assert "event: end" in list(lines)
    assert api.get(f"/v1/jobs/{job_id}/events", headers=auth(tokens["alice"])).status_code == 200  # its slot is free again


@pytest.mark.parametrize("max_restarts, failures, shown", [(0, 1, 0), (1, 1, 1), (1, 2, 1), (2, 2, 2)])
def test_restarts_counts_the_times_a_job_was_started_again_not_its_failures(api, settings, tokens, max_restarts, failures, shown):
    # A job with max_restarts 0 that failed once showed `restarts 1`: it was never restarted.
    job_id = api.post("/v1/jobs", json=tiny_spec(max_restarts=max_restarts), headers=auth(tokens["alice"])).json()["id"]
    for _ in range(failures):
        claimed = start_job(settings, job_id)
        with session_factory(settings.resolved_database_url)() as session:
            finish_attempt(session, claimed, AttemptStatus.failed, "boom")
    job = api.get(f"/v1/jobs/{job_id}", headers=auth(tokens["alice"])).json()
    assert job["restarts"] == shown and job["status"] == ("failed" if failures > max_restarts else "queued"), job


def test_a_cancels_answer_describes_the_job_as_get_does(api, tokens, settings):
    # Found by a new user: the answer to a finished job's cancel said last_train_loss null.
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    finish_job(settings, start_job(settings, job_id))
    answer = api.post(f"/v1/jobs/{job_id}/cancel", headers=auth(tokens["alice"]))
    shown = api.get(f"/v1/jobs/{job_id}", headers=auth(tokens["alice"])).json()
    assert answer.status_code == 200 and answer.json() == shown and shown["last_train_loss"] == 2.0 and shown["status"] == "succeeded"


def test_with_no_scheduler_running_a_queued_job_the_dashboard_and_metrics_say_so(api, tokens, settings):
    """With the scheduler stopped a job stayed queued with no reason, and /healthz answered ok."""
    sessions = session_factory(settings.resolved_database_url)
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    # No scheduler ever ran: the dashboard says so at once; a job just queued is given time for one to start.
    assert "no scheduler has run yet" in api.get("/v1/dashboard", headers=auth(tokens["alice"])).json()["scheduler_down"]
    assert api.get(f"/v1/jobs/{job_id}", headers=auth(tokens["alice"])).json()["waiting_reason"] is None
    with sessions() as session:
        schedule_pass(session, settings)  # no host: it notes why the job waits
        note_scheduler_pass(session, "sched:1", utcnow())
    job = api.get(f"/v1/jobs/{job_id}", headers=auth(tokens["alice"])).json()
    assert job["waiting_reason"] and "scheduler" not in job["waiting_reason"]
    assert api.get("/v1/dashboard", headers=auth(tokens["alice"])).json()["scheduler_down"] is None
    assert 0 <= prometheus_samples(api.get("/metrics").text)[("trainyard_scheduler_last_pass_age_seconds", frozenset())] < 60

    # Its last pass a minute ago, past MISSED_PASSES intervals: stopped, or crashed.
    with sessions() as session:
        note_scheduler_pass(session, "sched:1", utcnow() - timedelta(seconds=60))
    said = "no scheduler has made a pass for 60 s: nothing is placed until `trainyard scheduler` runs again"
    assert api.get(f"/v1/jobs/{job_id}", headers=auth(tokens["alice"])).json()["waiting_reason"] == said
    assert [item["waiting_reason"] for item in api.get("/v1/jobs", headers=auth(tokens["alice"])).json()["items"]] == [said]
    assert api.get("/v1/dashboard", headers=auth(tokens["alice"])).json()["scheduler_down"] == said
    assert prometheus_samples(api.get("/metrics").text)[("trainyard_scheduler_last_pass_age_seconds", frozenset())] >= 60
