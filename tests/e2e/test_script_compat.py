"""Scripts in the shapes third-party projects use (tests/e2e/scripts/), unchanged, as `script` jobs
on the embedded stack: killed with `kill -9` after a checkpoint, resumed from the folder they
saved under its own name, every checkpoint kept, tensor metrics recorded, each step's metrics once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.e2e.test_end_to_end import wait_for, wait_for_event
from tests.e2e.test_scripts import stack, training_processes, upload_code  # noqa: F401 (stack: the module's fixture)
from workers.launch import EVENTS_FILE_NAME, attempt_dir
from workers.supervisor import EventTail

pytestmark = pytest.mark.timeout(600)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# 160 samples, 4 a batch: 40 steps an epoch, 3 epochs.
CLM = ["--num_train_epochs", "3", "--train_samples", "160"]


def submit_and_kill_after_first_checkpoint(client, info, script: str, args: list[str]) -> tuple[int, dict]:
    """Runs `script` as a job with one restart, kills its training process with SIGKILL once it has
    written its first checkpoint, and waits for the job's end."""
    spec = {
        "name": script.replace(".py", "").replace("_", "-"),
        "script": {"entrypoint": script, "args": args, "code": {"upload_id": upload_code(client, SCRIPTS / script)},
                   "resume_args": ["--resume_from_checkpoint", "{checkpoint}"], "env": {"HF_HUB_OFFLINE": "1"}},
        "checkpoint": {"keep_last": 20},
        "max_restarts": 1,
    }
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    run_dir = attempt_dir(info.data_dir / "work", job_id, 1)
    wait_for_event(EventTail(run_dir / EVENTS_FILE_NAME), "checkpoint", timeout=300)
    victims = training_processes(run_dir / "code")
    assert victims, "the training process had already ended"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    return job_id, wait_for(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=500)


def metrics_written(info, job_id: int, attempt: int) -> list[dict]:
    path = attempt_dir(info.data_dir / "work", job_id, attempt) / EVENTS_FILE_NAME
    return [event for event in map(json.loads, path.read_text().splitlines()) if event["type"] == "metrics"]


def test_a_step_named_script_that_logs_once_an_epoch_keeps_every_checkpoint_and_resumes_by_its_own_folder_name(stack):
    client, info = stack
    job_id, job = submit_and_kill_after_first_checkpoint(client, info, "clm_no_trainer.py", [*CLM, "--checkpointing_steps", "20"])
    assert job["status"] == "succeeded", job["failure_reason"]
    assert job["failure_reason"] is None  # the failed first attempt keeps its own reason
    first, second = job["attempts"]
    assert first["status"] == "failed" and first["failure_reason"]
    resumed = second["resumed_from_step"]
    assert resumed >= 20 and resumed % 20 == 0

    # Each step_N folder is its own checkpoint at step N, though the script logs at epoch ends only.
    steps = [c["step"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json()]
    assert steps[-(120 - resumed) // 20:] == list(range(resumed + 20, 121, 20))
    assert set(steps) == set(range(20, 121, 20))
    # The script parsed the step out of the folder name it was given.
    logs = client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 2000}).json()["lines"]
    assert any(line["line"].startswith("Resumed from checkpoint: ") and line["line"].endswith(f"/step_{resumed}")
               for line in logs if line["attempt"] == 2)

    # The tensor eval_loss is a metric; each epoch's step is shown once, with the resumed attempt's value.
    series = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "eval_loss,perplexity"}).json()["series"]
    assert series["eval_loss"]["steps"] == [40, 80, 120]
    retrained = {event["step"]: event["values"]["eval_loss"] for event in metrics_written(info, job_id, 2)}
    assert all(value == pytest.approx(retrained[step]) for step, value in zip(series["eval_loss"]["steps"], series["eval_loss"]["values"])
               if step > resumed)
    assert not any("not a number" in line["line"] for line in logs)


def test_an_epoch_named_script_resumes_from_its_epoch_folder(stack):
    client, info = stack
    job_id, job = submit_and_kill_after_first_checkpoint(client, info, "clm_no_trainer.py", [*CLM, "--checkpointing_steps", "epoch"])
    assert job["status"] == "succeeded" and job["failure_reason"] is None
    assert job["attempts"][1]["resumed_from_step"] == 0  # epoch_0, numbered by its epoch
    assert [c["step"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json()][-2:] == [1, 2]
    assert client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "eval_loss"}).json()["series"]["eval_loss"]["steps"] == [40, 80, 120]
