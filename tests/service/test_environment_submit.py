"""Submitting jobs with `environment.pip`: what is refused, and that the environment is part of the
job's record (what the worker builds from it: tests/unit/test_environments.py, tests/e2e/test_environment_jobs.py)."""

from __future__ import annotations

import pytest

from service.db.accounts import create_user
from service.db.session import session_factory
from tests.helpers import auth, tiny_spec


@pytest.fixture
def tokens(settings) -> dict[str, str]:
    (settings.data_dir / "code" / "project").mkdir(parents=True)
    (settings.data_dir / "code" / "project" / "train.py").write_text("print('hi')\n")
    with session_factory(settings.resolved_database_url)() as session:
        return {"coder": create_user(session, "coder", can_run_code=True)[1], "plain": create_user(session, "plain")[1]}


def script_spec(pip: list[str], **script) -> dict:
    return {"name": "mine", "script": {"entrypoint": "train.py", "code": {"path": "project"}, **script}, "environment": {"pip": pip}}


def test_the_environment_is_part_of_the_jobs_record(api, tokens):
    response = api.post("/v1/jobs", json=script_spec(["tinypkg==1.2", "peft[torch]>=0.11,<1"]), headers=auth(tokens["coder"]))
    assert response.status_code == 201, response.text
    job = api.get(f"/v1/jobs/{response.json()['id']}", headers=auth(tokens["coder"])).json()
    assert job["spec"]["environment"] == {"pip": ["tinypkg==1.2", "peft[torch]>=0.11,<1"]}


@pytest.mark.parametrize(
    "pip, loc, reason",
    [
        (["tinypkg @ https://example.com/tinypkg.whl"], ["body", "environment", "pip", 0], "expected `name`, `name==1.2`"),
        (["tinypkg", "../wheels/x.whl"], ["body", "environment", "pip", 1], "no URL, path, option or marker"),
        (["tinypkg; os_name == 'nt'"], ["body", "environment", "pip", 0], "expected `name`"),
        (["--index-url=https://evil.example"], ["body", "environment", "pip", 0], "expected `name`"),
        (["torch==2.0.0", "tinypkg"], ["body", "environment", "pip"], "torch: the worker's own version is used"),
        (["Accelerate<0.1"], ["body", "environment", "pip"], "accelerate: the worker's own version is used"),
        (["Tiny_Pkg>=1", "tiny-pkg<2"], ["body", "environment", "pip"], "tiny-pkg: name each package once"),
        ([], ["body", "environment", "pip"], "at least 1 item"),
        (["six==!"], ["body", "environment", "pip", "0"], "not a requirement"),  # the pattern's gap, closed by admission
    ],
)
def test_a_malformed_requirement_gets_422_naming_environment_pip(api, tokens, pip, loc, reason):
    response = api.post("/v1/jobs", json=script_spec(pip), headers=auth(tokens["coder"]))
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["loc"] == loc and reason in error["msg"], error


def test_installing_packages_needs_can_run_code_whatever_the_jobs_kind(api, tokens):
    spec = {**tiny_spec(), "environment": {"pip": ["tinypkg"]}}
    refused = api.post("/v1/jobs", json=spec, headers=auth(tokens["plain"]))
    assert refused.status_code == 403 and "can_run_code" in refused.json()["detail"]
    assert api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["plain"])).status_code == 201
    assert api.post("/v1/jobs", json=spec, headers=auth(tokens["coder"])).status_code == 201


def test_a_script_may_require_what_its_environment_installs(api, tokens):
    spec = script_spec(["tinypkg==1.2"], requirements=["tinypkg>=1", "torch"])
    assert api.post("/v1/jobs", json=spec, headers=auth(tokens["coder"])).status_code == 201
    refused = api.post("/v1/jobs", json=script_spec(["tinypkg"], requirements=["otherpkg"]), headers=auth(tokens["coder"]))
    assert refused.status_code == 422
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", "script", "requirements", "0"] and "environment.pip does not name it" in error["msg"]
