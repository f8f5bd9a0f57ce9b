"""Submitting `script` jobs: who may, which code they may name (what the worker launches: tests/unit/test_launch.py)."""

from __future__ import annotations

import io
import tarfile

import pytest

from api_schemas import JobSpec
from service.api.main import create_app
from service.db.accounts import create_user, user_by_token
from service.db.checkpoints import list_checkpoints, record_checkpoint
from service.db.hosts import register_host
from service.db.metrics import record_metrics
from service.db.migrate import upgrade
from service.db.session import session_factory
from service.scheduler import schedule_pass
from common.settings import Settings
from tests.client.serve import serve_app
from tests.helpers import auth, start_job, tiny_spec
from trainyard.cli import main

OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture
def settings(settings) -> Settings:
    """With a script project under the code root."""
    (settings.data_dir / "code" / "project").mkdir(parents=True)
    (settings.data_dir / "code" / "project" / "train.py").write_text("print('hi')\n")
    return settings


@pytest.fixture
def tokens(settings) -> dict[str, str]:
    with session_factory(settings.resolved_database_url)() as session:
        return {
            "coder": create_user(session, "coder", can_run_code=True)[1],
            "other_coder": create_user(session, "other_coder", can_run_code=True)[1],
            "plain": create_user(session, "plain")[1],
        }


def script_spec(**script) -> dict:
    return {"name": "mine", "script": {"entrypoint": "train.py", "code": {"path": "project"}, **script}}


def bundle(api, token: str) -> int:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        data = b"print('bundled')\n"
        info = tarfile.TarInfo("train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    response = api.post("/v1/code", params={"name": "b.tar"}, content=out.getvalue(), headers={**auth(token), **OCTETS})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_a_script_job_is_queued_for_a_user_who_may_run_code(api, tokens):
    response = api.post("/v1/jobs", json=script_spec(args=["--lr", "3e-4"]), headers=auth(tokens["coder"]))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["spec"]["script"]["args"] == ["--lr", "3e-4"] and job["max_steps"] is None and job["effective_batch_size"] is None


def test_a_running_script_without_max_steps_shows_its_step_on_the_dashboard_and_in_the_cli(api, tokens, settings, capsys):
    coder = auth(tokens["coder"])
    job_id = api.post("/v1/jobs", json=script_spec(), headers=coder).json()["id"]
    claimed = start_job(settings, job_id)
    with session_factory(settings.resolved_database_url)() as session:
        record_metrics(session, job_id, claimed.attempt_id, [(7, "loss", 1.5)])

    dashboard = api.get("/v1/dashboard", headers=coder)
    assert dashboard.status_code == 200, dashboard.text
    [running] = dashboard.json()["running"]
    assert (running["id"], running["step"], running["max_steps"], running["progress"]) == (job_id, 7, None, None)
    job = api.get(f"/v1/jobs/{job_id}", headers=coder).json()
    assert job["status"] == "running" and job["step"] == 7 and job["max_steps"] is None and job["eta_seconds"] is None

    with serve_app(create_app(settings)) as url:
        for command in (["status", str(job_id)], ["dashboard"], ["ls"]):
            assert main([*command, "--server", url, "--token", tokens["coder"]]) == 0
            out = capsys.readouterr().out
            assert " 7 " in out.replace("\n", " ") and "None" not in out, (command, out)


def test_a_user_without_can_run_code_gets_403_saying_so(api, tokens):
    response = api.post("/v1/jobs", json=script_spec(), headers=auth(tokens["plain"]))
    assert response.status_code == 403 and "can_run_code" in response.json()["detail"]


def test_another_users_code_bundle_cannot_be_run(api, tokens):
    theirs = bundle(api, tokens["other_coder"])
    spec = script_spec(code={"upload_id": theirs})
    response = api.post("/v1/jobs", json=spec, headers=auth(tokens["coder"]))
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "script", "code", "upload_id"]
    assert api.post("/v1/jobs", json=spec, headers=auth(tokens["other_coder"])).status_code == 201


@pytest.mark.parametrize(
    "script, loc, reason",
    [
        ({"code": {"path": "../project"}}, ["body", "script", "code", "path"], "'..'"),
        ({"code": {"path": "/etc"}}, ["body", "script", "code", "path"], "relative path"),
        ({"code": {"path": "nowhere"}}, ["body", "script", "code", "path"], "no such code directory"),
        ({"code": {"path": "project", "upload_id": 1}}, ["body", "script", "code"], "exactly one"),
        ({"entrypoint": "missing.py"}, ["body", "script", "entrypoint"], "no file 'missing.py'"),
        ({"entrypoint": "../train.py"}, ["body", "script", "entrypoint"], "'..'"),
        # Found by a new user: each was accepted, then the worker's launch failed on it every attempt.
        ({"args": ["--tag", "x\0y"]}, ["body", "script"], "args: must not contain a NUL character"),
        ({"outputs": ["o\0ut"]}, ["body", "script"], "outputs: must not contain a NUL character"),
        ({"outputs": ["o" * 300]}, ["body", "script", "outputs"], "at most 255 bytes"),
        ({"entrypoint": "t" * 256 + ".py"}, ["body", "script", "entrypoint"], "at most 255 bytes"),  # was a 500
        ({"env": {"LOCAL_RANK": "3", "MASTER_PORT": "1"}}, ["body", "script", "env"], "LOCAL_RANK, MASTER_PORT: set by Trainyard itself"),
        ({"env": {"TORCHELASTIC_RUN_ID": "x"}}, ["body", "script", "env"], "set by Trainyard itself"),
        ({"env": {"TAG": "x\0"}}, ["body", "script"], "env: must not contain a NUL character"),
    ],
)
def test_bad_script_code_gets_422_naming_the_field(api, tokens, script, loc, reason):
    response = api.post("/v1/jobs", json=script_spec(**script), headers=auth(tokens["coder"]))
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["loc"] == loc and reason in error["msg"]


def test_requirements_must_be_packages_the_workers_provide(api, tokens):
    def submit(requirements: list[str]):
        return api.post("/v1/jobs", json=script_spec(requirements=requirements), headers=auth(tokens["coder"]))

    assert submit(["torch>=2.0", "Accelerate", "numpy"]).status_code == 201
    refused = submit(["torch", "left-pad==1.0"])
    assert refused.status_code == 422
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", "script", "requirements", "1"] and "no 'left-pad'" in error["msg"]
    # The last matches the schema's pattern but is no PEP 508 requirement: admission refuses it.
    for malformed in ["git+https://example.com/x.git", "../pkg", "torch; os_name == 'nt'", "torch==!"]:
        [error] = submit([malformed]).json()["detail"]
        assert error["loc"][:3] == ["body", "script", "requirements"]


def test_a_code_root_symlink_out_is_refused(api, tokens, settings, tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "train.py").write_text("")
    (settings.resolved_code_root / "escape").symlink_to(tmp_path / "outside")
    response = api.post("/v1/jobs", json=script_spec(code={"path": "escape"}), headers=auth(tokens["coder"]))
    assert response.status_code == 422 and "outside the code root" in response.json()["detail"][0]["msg"]


def test_a_script_job_leaves_out_model_dataset_and_optimizer_and_built_in_jobs_need_them():
    mixed = {**tiny_spec(), "script": script_spec()["script"]}
    with pytest.raises(ValueError, match="leave out model, dataset, optimizer"):
        JobSpec.model_validate(mixed)
    builtin = tiny_spec()
    del builtin["optimizer"], builtin["training"]["max_steps"]
    with pytest.raises(ValueError, match="optimizer, training.max_steps: required"):
        JobSpec.model_validate(builtin)


def test_user_create_grants_can_run_code_only_when_asked(tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path}/users.db"
    monkeypatch.setenv("TRAINYARD_DATABASE_URL", url)
    monkeypatch.setenv("TRAINYARD_DATA_DIR", str(tmp_path))
    upgrade(url)
    assert main(["user", "create", "carol", "--can-run-code"]) == 0 and main(["user", "create", "dave"]) == 0
    carol_token, dave_token = capsys.readouterr().out.split()
    with session_factory(url)() as session:
        assert user_by_token(session, carol_token).can_run_code
        assert not user_by_token(session, dave_token).can_run_code


def test_a_checkpoint_without_model_weights_downloads_as_a_tar_of_its_folder(api, tokens, settings):
    job_id = api.post("/v1/jobs", json=script_spec(), headers=auth(tokens["coder"])).json()["id"]
    directory = settings.resolved_artifact_root / "jobs" / str(job_id) / "checkpoints" / "step-00000004"
    directory.mkdir(parents=True)
    (directory / "optimizer.bin").write_bytes(b"optimizer state")
    with session_factory(settings.resolved_database_url)() as session:
        register_host(session, "host-a", "cpu", 1, {})
        [(attempt_id, _)] = schedule_pass(session, settings)
        record_checkpoint(session, job_id, attempt_id, 4, str(directory.relative_to(settings.resolved_artifact_root)), "0" * 64, 15, 2)
        checkpoint_id = list_checkpoints(session, job_id)[-1].id
    response = api.get(f"/v1/checkpoints/{checkpoint_id}/download", headers=auth(tokens["coder"]))
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        assert tar.extractfile(f"job{job_id}-step4/optimizer.bin").read() == b"optimizer state"
    assert api.get(f"/v1/checkpoints/{checkpoint_id}/download", headers=auth(tokens["plain"])).status_code == 404


def test_settings_a_script_decides_itself_are_refused_rather_than_ignored():
    spec = {**script_spec(), "training": {"micro_batch_size": 8, "precision": "bf16"}, "checkpoint": {"every_steps": 5, "keep_last": 3}}
    with pytest.raises(ValueError, match=r"training.micro_batch_size, checkpoint.every_steps would have no effect"):
        JobSpec.model_validate(spec)
    spec = {**script_spec(), "training": {"precision": "bf16", "gradient_accumulation_steps": 2, "max_steps": 100}, "checkpoint": {"keep_last": 3}}
    assert JobSpec.model_validate(spec).checkpoint.keep_last == 3
