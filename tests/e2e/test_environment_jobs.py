"""`environment.pip` through the whole embedded stack, sandboxed as every attempt is: a script job
imports a package installed from a local find-links directory (offline), the next job with the
same environment reuses it, a built-in job runs its training loop in one, a package that can't be
installed fails the job, naming it, and a job waiting for its environment's build keeps its lease
while other jobs go on, and can be cancelled."""

from __future__ import annotations

import fcntl
import shutil
import time


import httpx
import pytest
import torch

from stack.embedded import embedded_stack
from tests.e2e.test_end_to_end import wait_for
from tests.e2e.test_end_to_end import final_weights
from tests.e2e.test_scripts import EXAMPLES, TINY_GPT, run, script_spec
from trainyard.cli import main
from tests.helpers import tiny_spec
from tests.wheels import make_wheel
from workers.environments import EnvironmentCache
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)

SHOW = "import tinypkg\nprint('tinypkg says', tinypkg.MESSAGE, flush=True)\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("environments")
    wheels = root / "wheels"
    make_wheel(wheels, "tinypkg", "1.2", "MESSAGE = 'hello from a wheel'\n")
    # A .pth file runs in every Python started in the environment: it shows which Python a job ran.
    make_wheel(wheels, "tinymark", "0.1", "", extra_files={"tinymark.pth": "import sys; print('tinymark: in the job environment', file=sys.stderr)\n"})
    yard = root / "yard"
    (yard / "code" / "show").mkdir(parents=True)
    (yard / "code" / "show" / "show.py").write_text(SHOW)
    shutil.copytree(EXAMPLES, yard / "code" / "examples")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
        env.setenv("TRAINYARD_LEASE_SECONDS", "6")
        env.setenv("TRAINYARD_ENVIRONMENT_FIND_LINKS", f'["{wheels}"]')
        env.setenv("TRAINYARD_ENVIRONMENT_NO_INDEX", "true")  # offline: the directory of wheels only
        with embedded_stack(yard, free_port(), workers=1, devices="cpu:2") as info:
            with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
                yield client, info


def logs(client: httpx.Client, job_id: int) -> list[str]:
    return [line["line"] for line in client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 1000}).json()["lines"]]


def test_a_script_imports_what_its_environment_installs_and_the_next_job_reuses_it(stack):
    client, info = stack
    spec = {**script_spec("show", "show.py", [], {"path": "show"}), "environment": {"pip": ["tinypkg==1.2"]}}
    first = run(client, spec)
    assert first["spec"]["environment"] == {"pip": ["tinypkg==1.2"]}  # part of the job's record
    first_logs = logs(client, first["id"])
    assert "tinypkg says hello from a wheel" in first_logs
    assert any(line.startswith("trainyard: building environment") for line in first_logs)
    assert " + tinypkg==1.2" in first_logs  # uv's install log, in the job's logs

    # Checked at the worker against the job's environment: the package it installs, the worker's torch.
    second = run(client, {**spec, "name": "show-again", "script": {**spec["script"], "requirements": ["tinypkg>=1.2", "torch>=2"]}})
    second_logs = logs(client, second["id"])
    assert "tinypkg says hello from a wheel" in second_logs
    assert any(line.startswith("trainyard: environment") and line.endswith("is cached on this host; reused") for line in second_logs)
    assert not any("building environment" in line for line in second_logs)
    assert len([path for path in (info.data_dir / "environments").iterdir() if path.is_dir() and not path.name.startswith(".")]) == 1


def test_a_built_in_job_trains_in_its_environment(stack):
    client, _ = stack
    job = run(client, {**tiny_spec(**{"training.max_steps": 4, "checkpoint.every_steps": 4}), "environment": {"pip": ["tinymark"]}})
    assert job["step"] == 4
    assert "tinymark: in the job environment" in logs(client, job["id"])  # the loop's Python was the environment's


def test_a_package_that_cannot_be_installed_fails_the_job_naming_it(stack):
    client, _ = stack
    spec = {**script_spec("missing", "show.py", [], {"path": "show"}), "environment": {"pip": ["tinypkg", "nosuchpkg==1.0"]}}
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
    assert job["status"] == "failed"
    assert job["failure_reason"].splitlines()[0].endswith("environment.pip: could not install nosuchpkg==1.0:")
    assert any("nosuchpkg was not found" in line for line in logs(client, job_id))  # uv's words, in the job's logs
    assert len(job["attempts"]) == 1  # max_restarts 0: not tried again


def test_a_job_waiting_for_its_environments_build_keeps_its_lease_while_another_job_runs_and_can_be_cancelled(stack):
    client, info = stack
    requirements = ["tinypkg==1.2", "tinymark"]
    key = EnvironmentCache(info.data_dir / "environments", 1).key(requirements)  # the worker's key: the same Python and environment
    (info.data_dir / "environments").mkdir(exist_ok=True)
    # Another builder of that environment holds its build lock (as a slow download would).
    with open(info.data_dir / "environments" / f"{key}.build.lock", "a") as builder:
        fcntl.flock(builder, fcntl.LOCK_EX)
        spec = {**script_spec("waits", "show.py", [], {"path": "show"}), "environment": {"pip": requirements}}
        waiting = client.post("/v1/jobs", json=spec).json()["id"]
        wait_for(client, waiting, {"running"})
        # Another job, with an environment of its own, is neither held up by it nor waits for it.
        run(client, {**script_spec("goes-on", "show.py", [], {"path": "show"}), "environment": {"pip": ["tinypkg"]}})
        time.sleep(7)  # past the stack's 6 s lease: renewed while it waits
        job = client.get(f"/v1/jobs/{waiting}").json()
        assert job["status"] == "running" and [a["status"] for a in job["attempts"]] == ["running"]
        assert client.post(f"/v1/jobs/{waiting}/cancel").status_code in (200, 202)
        job = wait_for(client, waiting, {"succeeded", "failed", "cancelled"}, timeout=30)
    assert job["status"] == "cancelled" and job["attempts"][0]["status"] == "cancelled"


def test_a_rerun_of_a_script_job_in_its_environment_pins_what_it_resolved_and_trains_the_same_weights(stack, capsys):
    client, info = stack
    args = ["--max_steps", "6", "--checkpoint_every", "6", *TINY_GPT]
    spec = {**script_spec("rerun-script", "char_gpt.py", args, {"path": "examples"}), "environment": {"pip": ["tinypkg"]}}
    first = run(client, spec)
    [attempt] = client.get(f"/v1/jobs/{first['id']}/record").json()["attempts"]
    assert attempt["environment"]["environment_packages"]["tinypkg"] == "1.2" and "code" in attempt["environment"]["inputs"]

    cli = ["--server", info.url, "--token", info.token]
    assert main(["rerun", str(first["id"]), "--follow", *cli]) == 0
    rerun = client.get(f"/v1/jobs/{int(capsys.readouterr().out.split('submitted job ')[1].split()[0])}").json()
    assert rerun["status"] == "succeeded" and rerun["spec"]["environment"]["pip"] == ["tinypkg==1.2"]  # what it resolved, pinned
    weights, again = final_weights(client, first["id"]), final_weights(client, rerun["id"])
    assert weights.keys() == again.keys() and all(torch.equal(weights[name], again[name]) for name in weights)
