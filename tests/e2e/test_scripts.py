"""Unchanged Accelerate scripts (examples/) as `script` jobs through the whole embedded stack:
launched on 1 and 2 processes, metrics from `accelerator.log`, checkpoints from `save_state`
registered and downloadable, and a kill -9 of the training processes resumed from the last one.
Also the CLI's `submit --script` and `datasets upload`."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import tarfile
from pathlib import Path

import httpx
import psutil
import torch
import pytest
from safetensors.torch import load

from stack.embedded import embedded_stack
from tests.e2e.test_end_to_end import wait_for, wait_for_event
from tests.helpers import tiny_spec
from trainyard.cli import main
from workers.launch import EVENTS_FILE_NAME, attempt_dir
from workers.outbox import EventTail
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY_GPT = ["--block_size", "16", "--n_embd", "32", "--n_head", "2", "--n_layer", "1", "--batch_size", "4"]
RESUME = ["--resume_from_checkpoint", "{checkpoint}"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yard = tmp_path_factory.mktemp("scripts") / "yard"
    (yard / "code").mkdir(parents=True)
    shutil.copytree(EXAMPLES, yard / "code" / "examples")  # for `code.path`, under the code root
    with pytest.MonkeyPatch.context() as env:
        # Heartbeats short enough that a checkpoint is registered within a second. The lease stays
        # the production 30 s: no test here kills a worker, and a busy machine may delay a renewal.
        env.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
        with embedded_stack(yard, free_port(), workers=1, devices="cpu:2") as info:
            with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
                yield client, info


def upload_code(client: httpx.Client, *files: Path) -> int:
    """A tar.gz of `files` through POST /v1/code; returns the bundle's id."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for file in files:
            tar.add(file, arcname=file.name)
    response = client.post("/v1/code", params={"name": "bundle.tgz"}, content=out.getvalue(), headers={"Content-Type": "application/octet-stream"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def script_spec(name: str, entrypoint: str, args: list[str], code: dict, processes: int = 1, max_restarts: int = 0) -> dict:
    return {
        "name": name,
        "script": {"entrypoint": entrypoint, "args": args, "code": code, "resume_args": RESUME},
        "resources": {"processes_per_node": processes},
        "checkpoint": {"keep_last": 10},
        "max_restarts": max_restarts,
    }


def run(client: httpx.Client, spec: dict) -> dict:
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    job = wait_for(client, response.json()["id"], {"succeeded", "failed", "cancelled"})
    if job["status"] != "succeeded":  # the whole log says more than the reason's last lines (a rank's own error above the launcher's summary)
        lines = client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 400}).json()["lines"]
        pytest.fail(f"{job['failure_reason']}\nthe job's log:\n" + "\n".join(f"[{line['rank']}] {line['line']}" for line in lines))
    return job


@pytest.mark.parametrize("processes", [1, 2])
def test_the_char_gpt_script_reports_every_step_and_its_checkpoints_download(stack, processes):
    client, _ = stack
    bundle = upload_code(client, EXAMPLES / "char_gpt.py")
    args = ["--max_steps", "6", "--checkpoint_every", "3", *TINY_GPT]
    job = run(client, script_spec(f"char-gpt-{processes}", "char_gpt.py", args, {"upload_id": bundle}, processes))

    series = client.get(f"/v1/jobs/{job['id']}/metrics").json()["series"]
    assert series["train_loss"]["steps"] == series["lr"]["steps"] == [1, 2, 3, 4, 5, 6]  # from the main process only
    assert series["lr"]["values"][-1] == 0.0  # the script's cosine schedule, as it logged it

    checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()
    assert [c["step"] for c in checkpoints] == [3, 6]
    weights = client.get(f"/v1/checkpoints/{checkpoints[-1]['id']}/download")
    assert hashlib.sha256(weights.content).hexdigest() == checkpoints[-1]["sha256"]
    assert "tok.weight" in load(weights.content)  # save_state's model.safetensors

    with tarfile.open(fileobj=io.BytesIO(client.get(f"/v1/checkpoints/{checkpoints[-1]['id']}/download", params={"format": "tar"}).content)) as tar:
        names = {Path(name).name for name in tar.getnames()}
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "manifest.json"} <= names
    assert {f"random_states_{rank}.pkl" for rank in range(processes)} <= names  # every process's part


@pytest.mark.parametrize("processes", [1, 2])
def test_the_nlp_example_logs_evaluation_gathered_over_every_process(stack, processes):
    client, _ = stack
    code = {"path": "examples"}  # a directory under the code root this time
    job = run(client, script_spec(f"nlp-{processes}", "nlp_example.py", ["--num_epochs", "2"], code, processes))

    series = client.get(f"/v1/jobs/{job['id']}/metrics").json()["series"]
    # 320 training rows, 16 per batch per process, drop_last: 20 steps an epoch on 1 process, 10 on 2.
    per_epoch = 20 // processes
    assert series["train_loss"]["steps"] == list(range(1, 2 * per_epoch + 1))
    assert series["eval_accuracy"]["steps"] == [per_epoch, 2 * per_epoch]
    assert series["eval_accuracy"]["values"][-1] > 0.9  # the generated sentences are easy
    # Its folders are epoch_1 and epoch_2: a checkpoint is numbered by its folder's name.
    assert [c["step"] for c in client.get(f"/v1/jobs/{job['id']}/checkpoints").json()] == [1, 2]


def test_a_script_whose_requirements_the_host_does_not_meet_fails_saying_which(stack):
    client, _ = stack
    spec = script_spec("too-new", "char_gpt.py", ["--max_steps", "2", *TINY_GPT], {"path": "examples"})
    spec["script"]["requirements"] = ["torch>=99", "accelerate"]
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
    assert job["status"] == "failed" and f"torch {torch.__version__} is installed, the script needs >=99" in job["failure_reason"]
    assert "accelerate" not in job["failure_reason"]  # met

    spec["script"]["requirements"] = ["torch>=2", "accelerate"]
    run(client, {**spec, "name": "met"})


def kill_after_its_first_checkpoint(data_dir: Path, job_id: int) -> None:
    """SIGKILL the script's processes of the job's first attempt once its events file holds a checkpoint."""
    run_dir = attempt_dir(data_dir / "work", job_id, 1)
    wait_for_event(EventTail(run_dir / EVENTS_FILE_NAME), "checkpoint", timeout=120)
    victims = training_processes(run_dir / "code")
    assert victims, "the training process had already ended"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)


def training_processes(code_dir: Path) -> list[int]:
    """The script's own processes (not Accelerate's launcher): those running in the attempt's code directory."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path(os.readlink(entry / "cwd")) == code_dir and b"accelerate" not in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_script_killed_mid_run_resumes_from_its_last_checkpoint_and_repeats_no_step(stack):
    client, info = stack
    bundle = upload_code(client, EXAMPLES / "char_gpt.py")
    args = ["--max_steps", "1000", "--checkpoint_every", "50", *TINY_GPT]
    job_id = client.post("/v1/jobs", json=script_spec("char-gpt-killed", "char_gpt.py", args, {"upload_id": bundle}, max_restarts=1)).json()["id"]

    # Killed right after its first checkpoint is written: once the API lists it, a fast machine
    # may have trained all 1000 steps.
    kill_after_its_first_checkpoint(info.data_dir, job_id)

    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["failure_reason"]
    first, second = job["attempts"]
    assert first["status"] == "failed" and second["resumed_from_step"] >= 50 and second["resumed_from_step"] % 50 == 0
    # The resumed run starts right after the checkpoint's step: nothing before it is trained again.
    events = [json.loads(line) for line in (attempt_dir(info.data_dir / "work", job_id, 2) / EVENTS_FILE_NAME).read_text().splitlines()]
    steps = [e["step"] for e in events if e["type"] == "metrics"]
    assert steps == list(range(second["resumed_from_step"] + 1, 1001))
    assert client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss"}).json()["series"]["train_loss"]["steps"] == list(range(1, 1001))
    logs = client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 1000}).json()["lines"]
    assert any(f"at step {second['resumed_from_step']}" in line["line"] for line in logs if line["attempt"] == 2)


def test_the_readme_way_submits_a_script_with_the_cli_and_follows_it_to_success(stack, capsys):
    client, info = stack
    code = main([
        "submit", "--script", str(EXAMPLES / "char_gpt.py"), "--server", info.url, "--token", info.token, "--follow",
        "--", "--max_steps", "4", "--checkpoint_every", "2", *TINY_GPT,
    ])
    out, err = capsys.readouterr()
    assert code == 0, err
    job_id = int(out.split()[2])
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["name"] == "char_gpt" and job["spec"]["script"]["args"][:2] == ["--max_steps", "4"]
    assert client.get(f"/v1/jobs/{job_id}/metrics").json()["series"]["train_loss"]["steps"] == [1, 2, 3, 4]
    # The script's directory went with it.
    bundle = client.get(f"/v1/code/{job['spec']['script']['code']['upload_id']}").json()
    assert bundle["name"] == "examples.tar.gz"


def test_a_dataset_uploaded_with_the_cli_trains_a_built_in_job_by_its_id(stack, tmp_path, capsys):
    client, info = stack
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare.txt").read_text()[:20_000])
    assert main(["datasets", "upload", str(corpus), "--server", info.url, "--token", info.token]) == 0
    upload_id = int(capsys.readouterr().out.split()[2])
    spec = tiny_spec(**{"training.max_steps": 4, "checkpoint.every_steps": 4, "dataset.upload_id": upload_id})
    del spec["dataset"]["path"]
    job = run(client, spec)
    assert job["step"] == 4


def test_a_script_runs_across_two_worker_hosts(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("TRAINYARD_WARM_INTERPRETERS", "0")  # a script starts cold: warm ones would load torch for nothing
    with embedded_stack(tmp_path / "yard", free_port(), workers=2, devices="cpu:1") as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            bundle = upload_code(client, EXAMPLES / "char_gpt.py")
            spec = script_spec("two-hosts", "char_gpt.py", ["--max_steps", "6", "--checkpoint_every", "3", *TINY_GPT], {"upload_id": bundle})
            spec["resources"] = {"nodes": 2, "processes_per_node": 1}
            job = run(client, spec)
            assert sorted((a["node_rank"], a["status"]) for a in job["attempts"]) == [(0, "succeeded"), (1, "succeeded")]
            assert len({a["host_name"] for a in job["attempts"]}) == 2
            assert client.get(f"/v1/jobs/{job['id']}/metrics").json()["series"]["train_loss"]["steps"] == [1, 2, 3, 4, 5, 6]
            assert [c["step"] for c in client.get(f"/v1/jobs/{job['id']}/checkpoints").json()] == [3, 6]


def run_snippet(client: httpx.Client, tmp_path: Path, name: str, code: str, max_restarts: int = 0, timeout: float = 240) -> dict:
    """`code` as a one-file script job, run to its end; returns the job."""
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    spec = {"name": name, "script": {"entrypoint": script.name, "code": {"upload_id": upload_code(client, script)}}, "max_restarts": max_restarts}
    return wait_for(client, client.post("/v1/jobs", json=spec).json()["id"], {"succeeded", "failed", "cancelled"}, timeout=timeout)


REFUSED_CHECKPOINT = '''
import json, os, pathlib
checkpoint = pathlib.Path("ckpt").resolve()
checkpoint.mkdir()
(checkpoint / "weights.bin").write_bytes(b"x" * 10)
os.symlink("/etc/passwd", checkpoint / "passwd")  # no manifest, and a link: the store takes neither
with open(os.environ["TRAINYARD_EVENTS_FILE"], "a") as events:
    events.write(json.dumps({"type": "checkpoint", "step": 5, "path": str(checkpoint)}) + "\\n")
print("saved")
'''


def test_a_checkpoint_the_store_refuses_is_an_event_and_a_log_line_and_the_job_does_not_claim_success(stack, tmp_path):
    client, _ = stack
    job = run_snippet(client, tmp_path, "refused", REFUSED_CHECKPOINT, max_restarts=2)
    assert job["status"] == "failed" and "not retried: its last checkpoint was refused by the artifact store" in job["failure_reason"], job
    assert len(job["attempts"]) == 1  # its own code made it so, and would again
    events = [json.loads(line.removeprefix("data: ")) for line in client.get(f"/v1/jobs/{job['id']}/events", params={"follow": False}).text.splitlines()
              if line.startswith("data: ") and "checkpoint_refused" in line]
    assert [(event["data"]["step"], event["data"]["what"]) for event in events] == [(5, "attempt-1.1/ckpt")], events
    lines = [line["line"] for line in client.get(f"/v1/jobs/{job['id']}/logs").json()["lines"]]
    assert any(line.startswith("trainyard: checkpoint 'attempt-1.1/ckpt' (step 5) refused by the artifact store") for line in lines), lines
    assert client.get(f"/v1/jobs/{job['id']}/checkpoints").json() == []


LEAVES_A_DAEMON = '''
import os, subprocess, time
subprocess.Popen(["sleep", "600"], start_new_session=True)  # a helper never waited for, holding our output
if os.fork() == 0:
    os.setsid()
    time.sleep(600)
    os._exit(0)
print("main done")
'''


def test_a_script_that_leaves_a_daemon_behind_ends_with_its_main_process_and_takes_the_daemon_with_it(stack, tmp_path):
    # Bubblewrap's own PID 1 waited for every process of the sandbox: a 1 s job stayed `running` for minutes.
    client, _ = stack
    job = run_snippet(client, tmp_path, "daemon", LEAVES_A_DAEMON, timeout=90)
    assert job["status"] == "succeeded", job
    assert not [p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "600"]]


UNKEEPABLE_METRICS = '''
import json, os
with open(os.environ["TRAINYARD_EVENTS_FILE"], "a") as events:
    for event in ({"type": "metrics", "step": 1, "values": {"loss": 2.0, "x" * 100: 1.0}},  # a name past 64 characters
                  {"type": "metrics", "step": 2**40, "values": {"loss": 1.5}},  # a step past 32 bits
                  {"type": "metrics", "step": 2, "values": {"loss": 1.0}}):
        events.write(json.dumps(event) + "\\n")
print("logged")
'''


def test_metrics_the_service_cant_keep_are_left_out_saying_so_and_the_rest_are_stored(stack, tmp_path):
    # Sent, they were refused (422) or failed the database (500) every time, holding up every metric after them.
    client, _ = stack
    job = run_snippet(client, tmp_path, "unkeepable", UNKEEPABLE_METRICS)
    assert job["status"] == "succeeded", job["failure_reason"]
    series = client.get(f"/v1/jobs/{job['id']}/metrics", params={"names": "loss"}).json()["series"]
    assert series["loss"]["steps"] == [1, 2] and series["loss"]["values"] == [2.0, 1.0]
    lines = [line["line"] for line in client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 100}).json()["lines"]]
    assert any("longer than 64 characters; not recorded" in line for line in lines), lines
    assert any(f"step {2**40} is outside what the service keeps" in line for line in lines), lines


def test_a_script_whose_logged_loss_turns_nan_is_stopped_and_resumed_from_its_checkpoint_before_it(stack):
    # An epoch-numbered script (its checkpoints' steps are 1, 2, 3…, its metrics' 1…60) whose loss goes
    # NaN at step 40, the last of epoch 4, once: which checkpoints came before the spike is told by the
    # order it wrote them, not by their steps (epoch_4, saved after the NaN, holds NaN weights).
    client, _ = stack
    bundle = upload_code(client, Path(__file__).parent / "scripts" / "epochs_nan.py")
    spec = script_spec("nan-once", "epochs_nan.py", ["--epochs", "6", "--nan_at_step", "40"], {"upload_id": bundle})
    job = run(client, spec)

    first, second = job["attempts"]
    assert first["status"] == "preempted" and "loss guard: loss nan at step 40" in first["failure_reason"]
    assert second["resumed_from_step"] == 3 and job["rollbacks"] == 1  # from epoch_3, the last one written before the NaN
    series = client.get(f"/v1/jobs/{job['id']}/metrics", params={"names": "loss"}).json()["series"]["loss"]
    assert series["steps"] == list(range(1, 61)) and all(value is not None and value == value for value in series["values"])
    [mark] = job["rollback_marks"]
    assert (mark["first_step"], mark["resume_step"]) == (40, 3)
    for checkpoint in client.get(f"/v1/jobs/{job['id']}/checkpoints").json():  # none holds the NaN weights
        weights = load(client.get(f"/v1/checkpoints/{checkpoint['id']}/download").content)
        assert all(torch.isfinite(tensor).all() for tensor in weights.values()), checkpoint
