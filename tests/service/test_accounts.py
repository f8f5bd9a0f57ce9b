"""Tenancy basics through the API: tokens that expire, rotate and are revoked; the audit trail; usage."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import update

from service.db.accounts import create_user, revoke, user_by_name
from service.db.models import Attempt, User
from service.db.session import session_factory
from tests.helpers import auth, finish_job, start_job, tiny_spec


@pytest.fixture
def settings(settings):
    """With a script project under the code root, for the code jobs the audit trail must name."""
    (settings.data_dir / "code" / "project").mkdir(parents=True)
    (settings.data_dir / "code" / "project" / "train.py").write_text("print('hi')\n")
    return settings


@pytest.fixture
def sessions(settings):
    return session_factory(settings.resolved_database_url)


@pytest.fixture
def tokens(sessions) -> dict[str, str]:
    with sessions() as session:
        return {
            "alice": create_user(session, "alice", can_run_code=True)[1],
            "bob": create_user(session, "bob")[1],
            "root": create_user(session, "root", is_admin=True)[1],
            "temp": create_user(session, "temp", token_lifetime=timedelta(hours=1))[1],
        }


def test_a_token_past_its_lifetime_is_refused_saying_it_expired(api, tokens, sessions):
    assert api.get("/v1/jobs", headers=auth(tokens["temp"])).status_code == 200
    with sessions() as session:
        session.execute(update(User).where(User.name == "temp").values(token_expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
        session.commit()
    response = api.get("/v1/jobs", headers=auth(tokens["temp"]))
    assert response.status_code == 401 and "token expired at" in response.json()["detail"]


def test_a_rotated_token_replaces_the_old_one_at_once_and_keeps_its_lifetime(api, tokens):
    response = api.post("/v1/token/rotate", headers=auth(tokens["temp"]))
    assert response.status_code == 200, response.text
    new = response.json()
    assert new["token"].startswith("ty_") and new["token"] != tokens["temp"]
    expires = datetime.fromisoformat(new["expires_at"])
    assert timedelta(minutes=59) < expires - datetime.now(timezone.utc) <= timedelta(hours=1)
    assert api.get("/v1/jobs", headers=auth(tokens["temp"])).status_code == 401
    assert api.get("/v1/jobs", headers=auth(new["token"])).status_code == 200
    # A token without a lifetime stays without one.
    assert api.post("/v1/token/rotate", headers=auth(tokens["bob"])).json()["expires_at"] is None


def test_a_revoked_user_is_refused_everywhere_until_an_admin_rotates_a_new_token(api, tokens, sessions):
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["bob"])).json()["id"]
    with sessions() as session:
        revoke(session, user_by_name(session, "bob"))
    for method, path in [("GET", "/v1/jobs"), ("GET", f"/v1/jobs/{job_id}"), ("POST", f"/v1/jobs/{job_id}/cancel"), ("POST", "/v1/token/rotate")]:
        response = api.request(method, path, headers=auth(tokens["bob"]))
        assert response.status_code == 401 and response.json()["detail"].startswith("token revoked; ask an admin"), (method, path)
    # Revoking is not a guess: the address is not locked out for the others.
    assert api.get("/v1/jobs", headers=auth(tokens["alice"])).status_code == 200
    # And the audit trail names whose revoked token it was.
    with sessions() as session:
        _, root = create_user(session, "root2", is_admin=True)
    refused = api.get("/v1/audit", params={"limit": 2}, headers=auth(root)).json()["items"]
    assert [(e["user"], e["path"], e["status_code"]) for e in refused] == [("bob", "/v1/token/rotate", 401), ("bob", f"/v1/jobs/{job_id}/cancel", 401)]


def test_the_audit_trail_names_who_did_what_from_where_and_the_answer(api, tokens):
    alice, bob = auth(tokens["alice"]), auth(tokens["bob"])
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=alice).json()["id"]
    script = {"name": "mine", "script": {"entrypoint": "train.py", "code": {"path": "project"}}}
    script_id = api.post("/v1/jobs", json=script, headers=alice).json()["id"]
    assert api.post("/v1/jobs", json=script, headers=bob).status_code == 403  # no can_run_code: refused, and audited
    assert api.post(f"/v1/jobs/{job_id}/cancel", headers=bob).status_code == 404
    assert api.post(f"/v1/jobs/{job_id}/cancel", headers=alice).status_code == 200
    assert api.post("/v1/jobs", json=tiny_spec(), headers=auth("ty_wrong")).status_code == 401
    assert api.post(f"/v1/jobs/{job_id}/cancel", headers=auth("ty_wrong")).status_code == 401
    api.get("/v1/jobs", headers=alice)  # reads are not audited
    code = api.post("/v1/login-codes", headers=alice).json()["code"]
    assert api.post("/v1/login", json={"code": code}).status_code == 200  # whose browser signed in: was "-"

    assert api.get("/v1/audit", headers=alice).status_code == 403
    page = api.get("/v1/audit", headers=auth(tokens["root"]))
    assert page.status_code == 200, page.text
    seen = [(e["user"], e["method"], e["path"], e["status_code"], e["job_id"], e["detail"]) for e in reversed(page.json()["items"])]
    assert seen == [
        ("alice", "POST", "/v1/jobs", 201, job_id, "submit gpt job"),
        ("alice", "POST", "/v1/jobs", 201, script_id, "submit script job (train.py)"),
        ("bob", "POST", "/v1/jobs", 403, None, "submit script job (train.py)"),
        ("bob", "POST", f"/v1/jobs/{job_id}/cancel", 404, job_id, "cancel"),
        ("alice", "POST", f"/v1/jobs/{job_id}/cancel", 200, job_id, "cancel"),
        (None, "POST", "/v1/jobs", 401, None, None),
        (None, "POST", f"/v1/jobs/{job_id}/cancel", 401, job_id, None),
        ("alice", "POST", "/v1/login-codes", 201, None, "made a one-time login link"),
        ("alice", "POST", "/v1/login", 200, None, "signed a browser in"),
    ]
    entries = page.json()["items"]
    assert all(e["client_address"] == "testclient" for e in entries)
    assert all(abs(datetime.fromisoformat(e["at"]) - datetime.now(timezone.utc)) < timedelta(minutes=1) for e in entries)

    # Filters and pages; a time with an offset means that moment, whatever the offset.
    bobs = api.get("/v1/audit", params={"user": "bob"}, headers=auth(tokens["root"])).json()["items"]
    assert [e["status_code"] for e in bobs] == [404, 403]
    third = datetime.fromisoformat(entries[-3]["at"])
    for zone in (timezone.utc, timezone(timedelta(hours=9)), timezone(timedelta(hours=-5))):
        since = api.get("/v1/audit", params={"since": third.astimezone(zone).isoformat()}, headers=auth(tokens["root"])).json()["items"]
        assert [e["id"] for e in since] == [e["id"] for e in entries[:-2]], zone
    first = api.get("/v1/audit", params={"limit": 5}, headers=auth(tokens["root"])).json()
    rest = api.get("/v1/audit", params={"limit": 5, "cursor": first["next_cursor"]}, headers=auth(tokens["root"])).json()
    assert [e["id"] for e in first["items"] + rest["items"]] == [e["id"] for e in entries]


def test_usage_counts_device_seconds_per_user_and_job_and_shows_each_user_only_their_own(api, tokens, settings, sessions):
    alice_job = api.post("/v1/jobs", json=tiny_spec(name="a"), headers=auth(tokens["alice"])).json()["id"]
    finish_job(settings, start_job(settings, alice_job))
    bob_job = api.post("/v1/jobs", json=tiny_spec(name="b"), headers=auth(tokens["bob"])).json()["id"]
    start_job(settings, bob_job)  # still running
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    with sessions() as session:  # known times: alice's attempt 2 processes × 100 s; bob's 1 process, running since t0 + 50 s
        session.execute(update(Attempt).where(Attempt.job_id == alice_job).values(slots=2, started_at=t0, finished_at=t0 + timedelta(seconds=100)))
        session.execute(update(Attempt).where(Attempt.job_id == bob_job).values(started_at=t0 + timedelta(seconds=50)))
        session.commit()

    mine = api.get("/v1/usage", headers=auth(tokens["alice"])).json()
    assert [(u["user"], u["jobs"], u["device_seconds"]) for u in mine["users"]] == [("alice", 1, 200.0)]
    assert [(j["job_id"], j["name"], j["device_seconds"]) for j in mine["jobs"]] == [(alice_job, "a", 200.0)]

    everyone = api.get("/v1/usage", headers=auth(tokens["root"])).json()
    bob_seconds = (datetime.fromisoformat(everyone["until"]) - (t0 + timedelta(seconds=50))).total_seconds()
    assert [u["user"] for u in everyone["users"]] == ["bob", "alice"]  # most first
    assert everyone["users"][0]["device_seconds"] == pytest.approx(bob_seconds, abs=0.01)

    # A period clips each attempt to it: from t0 + 60 s, alice's attempt counts 2 × 40 s.
    since = (t0 + timedelta(seconds=60)).isoformat()
    clipped = api.get("/v1/usage", params={"since": since}, headers=auth(tokens["alice"])).json()
    assert clipped["users"][0]["device_seconds"] == 80.0
    in_tokyo = (t0 + timedelta(seconds=60)).astimezone(timezone(timedelta(hours=9))).isoformat()
    assert api.get("/v1/usage", params={"since": in_tokyo}, headers=auth(tokens["alice"])).json()["users"][0]["device_seconds"] == 80.0
    later = (t0 + timedelta(seconds=100)).isoformat()
    assert api.get("/v1/usage", params={"since": later}, headers=auth(tokens["alice"])).json()["users"] == []
    assert api.get("/v1/usage", params={"since": "yesterday"}, headers=auth(tokens["alice"])).status_code == 422


def test_uploads_and_sweeps_are_audited_with_what_they_made(api, tokens):
    alice = auth(tokens["alice"])
    upload = api.post("/v1/datasets", params={"name": "lines.txt"}, content=b"to be or not to be\n" * 10,
                      headers={**alice, "Content-Type": "application/octet-stream"}).json()
    sweep = {"name": "search", "base": tiny_spec(), "search_space": {"optimizer.lr": {"choice": [0.001, 0.003]}},
             "sampler": {"kind": "grid"}, "budget": {"max_trials": 2}}
    sweep_id = api.post("/v1/sweeps", json=sweep, headers=alice).json()["id"]
    assert api.post(f"/v1/sweeps/{sweep_id}/cancel", headers=alice).status_code == 200
    entries = api.get("/v1/audit", params={"user": "alice"}, headers=auth(tokens["root"])).json()["items"]
    assert [e["detail"] for e in reversed(entries)] == [
        f"upload dataset lines.txt (upload {upload['id']}, 190 bytes)",
        f"submit sweep search, sweep {sweep_id} (trials: gpt job)",
        f"cancel sweep {sweep_id}",
    ]
