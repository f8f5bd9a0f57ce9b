"""A one-time link signs a browser in (`trainyard open`): the code works once and briefly; the
browser's session acts as its user until it expires, the user's token is rotated, or the user is revoked."""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from service.api.main import create_app
from service.db.accounts import create_user, revoke, user_by_name
from service.db.models import BrowserSession, LoginCode, utcnow
from service.db.session import session_factory
from tests.helpers import auth, tiny_spec


@pytest.fixture
def sessions(settings):
    return session_factory(settings.resolved_database_url)


@pytest.fixture
def tokens(sessions) -> dict[str, str]:
    with sessions() as session:
        return {"alice": create_user(session, "alice")[1], "bob": create_user(session, "bob")[1]}


def sign_in(api: TestClient, token: str) -> str:
    made = api.post("/v1/login-codes", headers=auth(token))
    assert made.status_code == 201, made.text
    assert made.json()["link"] == "/dashboard#login=" + made.json()["code"]  # a fragment: no server or log sees it
    answer = api.post("/v1/login", json={"code": made.json()["code"]})
    assert answer.status_code == 200, answer.text
    return answer.json()["token"]


def test_a_login_code_signs_a_browser_in_as_its_user_once(api, tokens):
    made = api.post("/v1/login-codes", headers=auth(tokens["alice"])).json()
    browser = api.post("/v1/login", json={"code": made["code"]}).json()["token"]
    assert browser.startswith("tyb_") and browser != tokens["alice"]
    job = api.post("/v1/jobs", json=tiny_spec(), headers=auth(browser)).json()
    assert job["owner"] == "alice"
    assert [j["id"] for j in api.get("/v1/jobs", headers=auth(tokens["alice"])).json()["items"]] == [job["id"]]
    assert api.get("/v1/jobs", headers=auth(browser)).json()["items"][0]["id"] == job["id"]
    # Used up: a second exchange (a link opened twice, or copied from a history) gets nothing.
    again = api.post("/v1/login", json={"code": made["code"]})
    assert again.status_code == 401 and "trainyard open" in again.json()["detail"]
    assert api.post("/v1/login", json={"code": "not-a-code"}).status_code == 401
    assert api.post("/v1/login-codes").status_code == 401  # a code needs a token


def test_a_browser_session_can_make_no_credential(api, tokens):
    # Found by a new user: a session (24 h) rotated its user's token, so held one that never
    # expires, and the user's CLI was locked out; with login codes it could renew itself for ever.
    browser = sign_in(api, tokens["alice"])
    for path in ("/v1/token/rotate", "/v1/login-codes"):
        refused = api.post(path, headers=auth(browser))
        assert refused.status_code == 403 and "browser session" in refused.json()["detail"], refused.text
    assert api.get("/v1/jobs", headers=auth(tokens["alice"])).status_code == 200  # the user's token still works
    assert api.get("/v1/jobs", headers=auth(browser)).status_code == 200


def test_an_expired_code_and_an_expired_session_are_refused(api, tokens, sessions):
    code = api.post("/v1/login-codes", headers=auth(tokens["alice"])).json()["code"]
    with sessions() as session:
        session.execute(update(LoginCode).values(expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
    assert api.post("/v1/login", json={"code": code}).status_code == 401

    browser = sign_in(api, tokens["alice"])
    assert api.get("/v1/jobs", headers=auth(browser)).status_code == 200
    with sessions() as session:
        session.execute(update(BrowserSession).values(expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
    assert api.get("/v1/jobs", headers=auth(browser)).status_code == 401


def test_rotating_the_users_token_or_revoking_the_user_ends_its_browser_sessions(api, tokens, sessions):
    browser = sign_in(api, tokens["alice"])
    other = sign_in(api, tokens["bob"])
    rotated = api.post("/v1/token/rotate", headers=auth(tokens["alice"])).json()["token"]
    assert api.get("/v1/jobs", headers=auth(browser)).status_code == 401  # the leaked token's sessions end with it
    assert api.get("/v1/jobs", headers=auth(other)).status_code == 200  # another user's are theirs

    browser = sign_in(api, rotated)
    unused = api.post("/v1/login-codes", headers=auth(rotated)).json()["code"]
    with sessions() as session:
        revoke(session, user_by_name(session, "alice"))
    assert api.get("/v1/jobs", headers=auth(browser)).status_code == 401
    assert api.post("/v1/login", json={"code": unused}).status_code == 401  # a revoked user's code opens nothing


def test_wrong_codes_count_as_wrong_tokens_do(settings, tokens):
    api = TestClient(create_app(settings.model_copy(update={"max_failed_auths_per_minute": 3})))
    for _ in range(3):
        assert api.post("/v1/login", json={"code": "guess"}).status_code == 401
    refused = api.post("/v1/login", json={"code": "guess"})
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
    assert api.post("/v1/login", json={}).status_code == 422  # no code: the field named, not a 500
