"""Scripts in the shapes third-party projects use (tests/e2e/scripts/), unchanged, as `script` jobs
on the embedded stack: killed with `kill -9` after a checkpoint, resumed from the folder they
saved under its own name, every checkpoint kept, tensor metrics recorded, each step's metrics once;
a script that never logs kept alive by its checkpoints; one whose folders Accelerate names and
rotates (`automatic_checkpoint_naming`, `total_limit`), on 1 and 2 processes, ending where an
uninterrupted run does; a `save_pretrained` output directory
collected and fetched with `trainyard outputs`; and Accelerate's own test scripts, from the
installed package, on 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import accelerate.test_utils.scripts
import pytest

from tests.e2e.test_end_to_end import wait_for, wait_for_event
from tests.e2e.test_scripts import run, stack, training_processes, upload_code  # noqa: F401 (stack: the module's fixture)
from trainyard.cli import main
from workers.launch import EVENTS_FILE_NAME, attempt_dir
from workers.outbox import EventTail

pytestmark = pytest.mark.timeout(600)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# 160 samples, 4 a batch: 40 steps an epoch, 3 epochs.
CLM = ["--num_train_epochs", "3", "--train_samples", "160"]


def submit_and_kill_after_first_checkpoint(client, info, script: str, args: list[str], **spec_sections) -> tuple[int, dict]:
    """Runs `script` as a job with one restart (and `spec_sections`), kills its training process
    with SIGKILL once it has written its first checkpoint, and waits for the job's end."""
    spec = {
        "name": script.replace(".py", "").replace("_", "-"),
        "script": {"entrypoint": script, "args": args, "code": {"upload_id": upload_code(client, SCRIPTS / script)},
                   "resume_args": ["--resume_from_checkpoint", "{checkpoint}"], "env": {"HF_HUB_OFFLINE": "1"}},
        "checkpoint": {"keep_last": 20},
        "max_restarts": 1,
        **spec_sections,
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
    processes = 2  # the harder case: one process is the epoch-named test's, and tests/e2e/test_scripts.py's
    # Twice the samples on 2 processes: the same 40 steps an epoch, each process a half of them.
    args = ["--num_train_epochs", "3", "--train_samples", str(160 * processes), "--checkpointing_steps", "20"]
    resources = {"resources": {"processes_per_node": processes, "device": "cpu"}}
    job_id, job = submit_and_kill_after_first_checkpoint(client, info, "clm_no_trainer.py", args, **resources)
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


def test_a_script_that_never_logs_keeps_every_checkpoint_by_its_folder_name_and_is_not_taken_for_stalled(stack):
    client, info = stack
    # 750 steps of 0.05 s, a checkpoint every 50: the resumed attempt (from step 50 or 100) trains
    # longer than the stall timeout with no metric at all, its checkpoints its only sign of progress.
    # The timeout also covers the first attempt's start to its first checkpoint, which on CI's two
    # busy cores took over 15 s.
    args = ["--max_steps", "750", "--save_every", "50", "--step_seconds", "0.05"]
    # keep_best by an eval_loss it never logs: every checkpoint still kept, and its logs say why none is the best.
    job_id, job = submit_and_kill_after_first_checkpoint(client, info, "saves_only.py", args, training={"stall_timeout_s": 30},
                                                         checkpoint={"keep_last": 20, "keep_best": True})
    assert job["status"] == "succeeded", job["failure_reason"]
    first, second = job["attempts"]
    assert first["status"] == "failed"
    resumed = second["resumed_from_step"]
    assert resumed >= 50 and resumed % 50 == 0
    assert {c["step"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json()} == set(range(50, 751, 50))
    series = client.get(f"/v1/jobs/{job_id}/metrics").json()["series"]
    assert not [name for name in series if not name.startswith("sys/")]  # none of its own, only the machine's samples
    logs = client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 200}).json()["lines"]
    assert any(line["line"] == f"resumed at step {resumed}" for line in logs if line["attempt"] == 2)
    assert [line["line"] for line in logs if "never logged" in line["line"] and line["attempt"] == 2] == [
        "trainyard: checkpoint.keep_best ranks checkpoints by 'eval_loss', which this attempt never logged: no checkpoint is kept as its best "
        "(checkpoint.best_metric; it logged: none)"]
    assert not any(c["best"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json())


def test_a_script_with_automatic_checkpoint_naming_keeps_each_save_past_its_total_limit_and_resumes_to_the_same_end(stack):
    client, info = stack
    processes = 2  # each process's save_state() call: the one-process case is the same files, fewer writers
    # 200 steps of 0.02 s, a bare save_state() every 20 (checkpoint_0 … checkpoint_9), total_limit=2:
    # Accelerate deletes a save two saves later, so each must be taken into the store before that.
    args = ["--max_steps", "200", "--save_every", "20", "--step_seconds", "0.02"]
    resources = {"resources": {"processes_per_node": processes, "device": "cpu"}}
    job_id, job = submit_and_kill_after_first_checkpoint(client, info, "auto_named.py", args, **resources)
    assert job["status"] == "succeeded", job["failure_reason"]
    first, second = job["attempts"]
    assert first["status"] == "failed"
    iteration = second["resumed_from_step"]  # an automatic name's number: Accelerate's count of saves
    assert {c["step"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json()} == set(range(10))
    logs = client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 500}).json()["lines"]
    assert any(line["line"] == f"resumed from checkpoint_{iteration} at step {(iteration + 1) * 20}" for line in logs if line["attempt"] == 2)

    # N == N/2 + kill + resume + N/2: the same weights as a run never interrupted.
    whole = run(client, {"name": "auto-named-whole", "script": {"entrypoint": "auto_named.py", "args": args,
                         "code": {"upload_id": upload_code(client, SCRIPTS / "auto_named.py")}}, **resources})
    def ending(job_id: int, attempt: int) -> str:
        lines = client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 50}).json()["lines"]
        return next(line["line"] for line in lines if line["attempt"] == attempt and line["line"].startswith("done at step"))
    assert ending(job_id, 2) == ending(whole["id"], 1)


def test_a_save_pretrained_output_directory_is_collected_and_trainyard_outputs_fetches_it_loadable(stack, tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    client, info = stack
    spec = {
        "name": "clm-outputs",
        "script": {"entrypoint": "clm_no_trainer.py", "args": ["--num_train_epochs", "1", "--train_samples", "40", "--output_dir", "out"],
                   "code": {"upload_id": upload_code(client, SCRIPTS / "clm_no_trainer.py")}, "env": {"HF_HUB_OFFLINE": "1"},
                   "outputs": ["out", "never-written"]},
    }
    job = run(client, spec)
    [output] = client.get(f"/v1/jobs/{job['id']}/outputs").json()
    assert output["name"] == "out" and output["step"] == 10 and output["files"] >= 2
    logs = client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 200}).json()["lines"]
    assert any("output 'never-written' not collected: no such directory" in line["line"] for line in logs)

    assert main(["outputs", str(job["id"]), "-o", str(tmp_path), "--server", info.url, "--token", info.token]) == 0
    assert f"saved {tmp_path / 'out'}/" in capsys.readouterr().out
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert (model.config.n_layer, model.config.n_embd) == (1, 32)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]  # nothing else left behind
    # A second fetch into the same place does not overwrite what is there.
    assert main(["outputs", str(job["id"]), "-o", str(tmp_path), "--server", info.url, "--token", info.token]) == 1
    assert "exists already" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["test_script.py", "test_sync.py", "test_ops.py"])
def test_accelerates_own_test_scripts_pass_on_two_processes(stack, script):
    client, info = stack
    # Copied from the installed package at test time, under the code root; never kept in the repository.
    code = info.data_dir / "code" / "accelerate_scripts"
    if not code.exists():
        shutil.copytree(accelerate.test_utils.scripts.__path__[0], code, ignore=shutil.ignore_patterns("__pycache__"))
    spec = {
        "name": f"accelerate-{script.removesuffix('.py').replace('_', '-')}",
        "script": {"entrypoint": script, "code": {"path": "accelerate_scripts"}},
        "resources": {"processes_per_node": 2, "device": "cpu"},
        # test_sync.py asserts that two gradients differ beyond allclose's tolerance, on data it draws
        # unseeded (RegressionDataset(seed=None)): now and then they don't (1 suite run in ~30 here).
        # One restart, as its user would give it; a real fault fails both attempts.
        "max_restarts": 1 if script == "test_sync.py" else 0,
    }
    run(client, spec)
