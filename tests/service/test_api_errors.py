"""Whose fault a failed request is: bad input gets a 422 naming the field (test_api.py,
test_script_jobs.py, test_uploads.py); anything else that goes wrong is the server's, a 500 with a
request id that finds its traceback in the log."""

from __future__ import annotations

import logging

import pytest
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from api_schemas.host_api import HOST_API_PREFIX
from service.api.main import create_app
from service.db.accounts import create_user
from service.db.checkpoints import list_checkpoints, record_checkpoint
from service.db.host_tokens import issue_host_token
from service.db.session import session_factory
from tests.helpers import auth, start_job, tiny_spec


@pytest.fixture
def token(settings) -> str:
    with session_factory(settings.resolved_database_url)() as session:
        return create_user(session, "alice")[1]


def assert_internal_error(response, caplog, exception: type[Exception]) -> None:
    """A 500 that blames the server, and the one log record with its traceback under the same id."""
    assert response.status_code == 500, response.text
    request_id = response.headers["X-Request-ID"]
    assert response.json() == {"detail": "internal error", "request_id": request_id}
    [record] = [r for r in caplog.records if r.name == "trainyard.api"]
    assert record.request_id == request_id and request_id in record.getMessage()
    assert record.levelno == logging.ERROR and record.exc_info[0] is exception


@pytest.mark.parametrize("exception", [ValueError, RuntimeError])
def test_a_route_that_fails_unexpectedly_answers_500_with_a_request_id_that_is_in_the_log(settings, caplog, exception):
    app = create_app(settings)

    @app.get("/fails")
    def fails():
        raise exception("a bug, not the caller's fault")

    response = TestClient(app).get("/fails")
    assert_internal_error(response, caplog, exception)
    assert "a bug" not in response.text  # the details stay in the log


def test_a_stream_that_fails_midway_is_cut_short_and_logged_once(settings, caplog):
    app = create_app(settings)

    @app.get("/stream")
    def stream():
        def lines():
            yield b"first\n"
            raise RuntimeError("a bug mid-stream")

        return StreamingResponse(lines())

    response = TestClient(app).get("/stream")
    assert response.status_code == 200 and response.content == b"first\n"  # too late to answer 500
    [record] = [r for r in caplog.records if r.name == "trainyard.api"]
    assert record.request_id in record.getMessage() and record.exc_info[0] is RuntimeError


def test_a_checkpoint_recorded_outside_the_artifact_store_is_a_server_error(api, settings, token, caplog):
    # The store refuses the path with a ValueError; that once answered 422, blaming the caller.
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(token)).json()["id"]
    claimed = start_job(settings, job_id)
    with session_factory(settings.resolved_database_url)() as session:
        record_checkpoint(session, job_id, claimed.attempt_id, 12, "../../elsewhere", "0" * 64, 10, keep_last=2)
        checkpoint_id = list_checkpoints(session, job_id)[-1].id
    response = api.get(f"/v1/checkpoints/{checkpoint_id}/download", headers=auth(token))
    assert_internal_error(response, caplog, ValueError)



def test_every_integer_parameter_past_what_the_database_holds_is_a_422_naming_it(api, settings):
    # `from_step=99999999999999999999` was a 500 on PostgreSQL (integer out of range). Every integer
    # in a query, path or header of a GET route, from the schema itself, at 10**20, as an admin (who may call them all).
    with session_factory(settings.resolved_database_url)() as session:
        token = create_user(session, "root", is_admin=True)[1]
        host_token = issue_host_token(session, "probe-host")  # the worker protocol's routes take a host's
    job = api.post("/v1/jobs", json=tiny_spec(), headers=auth(token)).json()["id"]
    huge = str(10**20)
    probed = 0
    for path, methods in api.app.openapi()["paths"].items():
        for parameter in methods.get("get", {}).get("parameters", []):
            schema = parameter["schema"].get("anyOf", [parameter["schema"]])[0]
            if schema.get("type") != "integer":
                continue
            url = path.replace("{" + parameter["name"] + "}", huge).replace("{job_id}", str(job))
            url = url.replace("{checkpoint_id}", "1").replace("{sweep_id}", "1").replace("{output_id}", "1")
            location = parameter["in"]
            response = api.get(
                url, params={parameter["name"]: huge} if location == "query" else None,
                headers={**auth(host_token if path.startswith(HOST_API_PREFIX) else token), **({parameter["name"]: huge} if location == "header" else {})},
            )
            assert response.status_code == 422, (url, parameter["name"], response.status_code, response.text)
            assert parameter["name"] in {str(part) for error in response.json()["detail"] for part in error["loc"]}, response.text
            probed += 1
    assert probed >= 8


def test_a_nan_in_a_spec_is_a_422_naming_the_field_not_a_500(api, token):
    # Python's json reads NaN; the 422 echoes the input it refused, which must still be JSON.
    body = '{"name": "x", "training": {"max_steps": NaN, "guard": {"min_increase": Infinity}}}'
    response = api.post("/v1/jobs", content=body, headers={**auth(token), "Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    locations = {".".join(map(str, error["loc"])) for error in response.json()["detail"]}
    assert {"body.training.max_steps", "body.training.guard.min_increase"} <= locations


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        (("training", "max_steps"), True, "max_steps: a number is needed, not true"), (("optimizer", "lr"), "NaN", "finite number"),
        (("dataset", "path"), "small.txt\0x", "path: must not contain a NUL character"),  # was a 500
        (("dataset", "path"), "o" * 300, "at most 255 bytes"),  # was a 500
    ],
)
def test_a_number_given_as_true_or_nan_or_an_impossible_path_is_a_422_saying_so(api, token, field, value, says):
    # Found by a new user: Pydantic's lax mode ran `"max_steps": true` as 1 step, and `"lr": "NaN"`
    # was refused as "≤ 10".
    spec = tiny_spec(**{".".join(field): value})
    response = api.post("/v1/jobs", json=spec, headers=auth(token))
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert tuple(error["loc"][1:3]) in {field, field[:1]} and says in error["msg"], error


def test_a_body_that_is_not_utf8_is_a_422_not_a_500(api, token, settings):
    # Found trying the worker protocol as a hostile client: the 422 echoed the undecodable bytes (a 500).
    with session_factory(settings.resolved_database_url)() as session:
        host_token = issue_host_token(session, "host-a")
    for path, who in (("/v1/jobs", token), ("/v1/host/attempts/1/lease", host_token), ("/v1/host/register", host_token)):
        for content_type in ({}, {"Content-Type": "application/octet-stream"}):  # JSON's own type: a 400, "error parsing the body"
            response = api.post(path, content=b"\xff{{", headers={**auth(who), **content_type})
            assert response.status_code == 422, (path, content_type, response.text)
