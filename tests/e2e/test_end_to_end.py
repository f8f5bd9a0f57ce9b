"""The whole service through HTTP: API, scheduler, Celery worker, training processes, artifact store.

Runs on both backend pairs: the embedded default (SQLite + Celery over the kombu SQLAlchemy
transport) and production (PostgreSQL + Redis).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import io
import tarfile
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as safetensors_load

from api_schemas import JobSpec, JobStatus
from api_schemas.worker_protocol import CheckpointEvent, MetricsEvent
from stack.embedded import embedded_stack
from tests.training.support import CORPUS
from trainyard.cli import main
from tests.helpers import classifier_spec, guarded_classifier_spec, tiny_spec, write_labelled_jsonl, write_poisoned_labels
from workers.outbox import EventTail
from workers.supervisor import free_port
from workers.training import eval_dataloader, evaluate, load_model, load_text_corpus

pytestmark = pytest.mark.timeout(300)



# What depends on the backends (a job's whole path, cancel) runs on both; what is the worker's and
# the training's alone runs on the embedded one (the service's part is in tests/service, on both).
ON_ONE_BACKEND = pytest.mark.parametrize("stack", ["sqlite+sqla-transport"], indirect=True)


@pytest.fixture(scope="module", params=["sqlite+sqla-transport", "postgres+redis"])
def stack(request, tmp_path_factory):
    """One stack per backend pair for the module's tests: each test's jobs are its own."""
    urls = {}
    if request.param == "postgres+redis":
        urls = {"database_url": request.getfixturevalue("module_postgres_url"), "broker_url": request.getfixturevalue("module_redis_url")}
    with embedded_stack(tmp_path_factory.mktemp("stack") / "yard", free_port(), workers=1, **urls) as info:
        client = httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30)
        yield client, info
        client.close()


def wait_for(client: httpx.Client, job_id: int, statuses: set[str], timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s: {job}")


def final_weights(client: httpx.Client, job_id: int) -> dict[str, torch.Tensor]:
    """The model weights of the job's latest checkpoint, downloaded."""
    latest = max(client.get(f"/v1/jobs/{job_id}/checkpoints").json(), key=lambda c: c["step"])
    return safetensors_load(client.get(f"/v1/checkpoints/{latest['id']}/download").content)


def wait_for_step(client: httpx.Client, job_id: int, step: int, timeout: float = 180) -> dict:
    """Until the job has reported `step`; fails at once, saying why, if it ends before."""
    deadline = time.monotonic() + timeout
    while (job := client.get(f"/v1/jobs/{job_id}").json())["step"] < step:
        assert not JobStatus(job["status"]).is_final, f"job {job_id} ended {job['status']} at step {job['step']}: {job}"
        assert time.monotonic() < deadline, f"job {job_id} stuck at step {job['step']} after {timeout} s: {job}"
        time.sleep(0.2)
    return job


def wait_for_checkpoint(client: httpx.Client, job_id: int, timeout: float = 180) -> list[dict]:
    """Until the job has a complete checkpoint; fails at once, saying why, if it ends before."""
    deadline = time.monotonic() + timeout
    while not (checkpoints := client.get(f"/v1/jobs/{job_id}/checkpoints").json()):
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert not JobStatus(job["status"]).is_final, f"job {job_id} ended {job['status']} with no checkpoint: {job}"
        assert time.monotonic() < deadline, f"no checkpoint was registered in {timeout} s: {job}"
        time.sleep(0.1)
    return checkpoints


def wait_for_event(events: EventTail, kind: str, timeout: float = 180) -> MetricsEvent | CheckpointEvent:
    """The next event of `kind` in an attempt's events file, as the training writes it: sooner than
    the API hears of it, which on a fast machine can be after the job has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in events.read():
            if event.type == kind:
                return event
        time.sleep(0.005)
    raise AssertionError(f"the training wrote no {kind} event within {timeout} s")


def test_a_job_trains_reports_every_step_and_its_checkpoint_downloads_and_loads(stack, tmp_path):
    client, info = stack
    succeeded_before = client.get("/v1/dashboard").json()["jobs_by_status"].get("succeeded", 0)  # the module's other tests' jobs
    spec = tiny_spec(**{"training.max_steps": 12, "training.eval_every": 6, "checkpoint.every_steps": 6})
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["failure_reason"]
    assert job["step"] == 12 and job["attempts"][0]["status"] == "succeeded"

    # Every optimizer step reported exactly once, every metric.
    series = client.get(f"/v1/jobs/{job_id}/metrics").json()["series"]
    for name in ("train_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_memory_mb"):
        assert series[name]["steps"] == list(range(1, 13)), name
    # What the spec says the loop reports (a sweep's objective is checked against it) is what it reports.
    assert {name for name in series if not name.startswith("sys/")} == set(JobSpec.model_validate(spec).reported_metrics())
    assert series["eval_loss"]["steps"] == [6, 12]
    assert client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "eval_loss", "from_step": 7}).json()["series"] == {
        "eval_loss": {"steps": [12], "values": [series["eval_loss"]["values"][1]]}
    }

    # Complete checkpoints only, newest kept per keep_last.
    checkpoints = client.get(f"/v1/jobs/{job_id}/checkpoints").json()
    assert [c["step"] for c in checkpoints] == [6, 12]
    latest = checkpoints[-1]

    # The download is the checkpoint's weights, verified by sha256, and resumable by Range.
    response = client.get(f"/v1/checkpoints/{latest['id']}/download")
    assert response.status_code == 200
    body = response.content
    assert hashlib.sha256(body).hexdigest() == response.headers["x-checkpoint-sha256"] == latest["sha256"]
    assert len(body) == latest["size_bytes"]
    tail = client.get(f"/v1/checkpoints/{latest['id']}/download", headers={"Range": "bytes=1000-"})
    assert tail.status_code == 206 and tail.content == body[1000:]

    # Loaded into a fresh model of the spec, the weights reproduce the job's last eval_loss (the whole split's).
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(body)
    job_spec = JobSpec.model_validate(spec)
    corpus = load_text_corpus(job_spec.dataset, info.data_dir / "data")
    model = load_model(job_spec, corpus.tokenizer.vocab_size, weights)
    assert evaluate(model, eval_dataloader(corpus.val, job_spec, whole=True)) == pytest.approx(series["eval_loss"]["values"][-1], abs=1e-4)

    # The tar format carries the full resumable state.
    archive = tarfile.open(fileobj=io.BytesIO(client.get(f"/v1/checkpoints/{latest['id']}/download", params={"format": "tar"}).content))
    names = {Path(name).relative_to(Path(name).parts[0]).as_posix() for name in archive.getnames()}
    assert {"model.safetensors", "manifest.json", "trainer_state.json", "state/optimizer.bin", "state/scheduler.bin"} <= names

    # The dashboard counts it and shows the worker.
    dashboard = client.get("/v1/dashboard").json()
    assert dashboard["jobs_by_status"]["succeeded"] == succeeded_before + 1
    assert [w["name"] for w in dashboard["workers"]] == ["local-0"] and dashboard["workers"][0]["online"]
    assert client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 5}).json()["lines"]


@ON_ONE_BACKEND
def test_a_checkpoint_every_step_is_stored_before_the_loop_moves_on(stack):
    """The loop leaves its checkpoints to the worker, which deletes each once stored: none is pruned
    before the worker copied it, however fast the steps."""
    client, info = stack
    spec = tiny_spec(**{"training.max_steps": 40, "checkpoint.every_steps": 1, "checkpoint.keep_last": 1})
    job = wait_for(client, client.post("/v1/jobs", json=spec).json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["failure_reason"]
    assert [c["step"] for c in client.get(f"/v1/jobs/{job['id']}/checkpoints").json()] == [40]
    assert list((info.data_dir / "work").rglob("step-*")) == []  # every local copy handed over and removed


@ON_ONE_BACKEND
def test_keep_best_keeps_the_best_evaluations_checkpoint_of_an_overfitting_job_and_it_downloads(stack, capsys):
    """A model that memorises 1,100 characters: its eval_loss bottoms out, then climbs. The checkpoint
    of the best evaluation is kept past keep_last 1, marked, and its weights are that step's."""
    client, info = stack
    (info.data_dir / "data" / "small.txt").write_text(CORPUS.read_text(encoding="utf-8")[:1200], encoding="utf-8")
    spec = tiny_spec(**{
        "dataset.path": "small.txt", "model.n_layer": 2, "model.n_embd": 64, "training.micro_batch_size": 16,
        "training.max_steps": 240, "training.eval_every": 20, "training.eval_batches": None, "optimizer.lr": 1e-2,
        "checkpoint.every_steps": None, "checkpoint.keep_last": 1, "checkpoint.keep_best": True,
    })
    job = wait_for(client, client.post("/v1/jobs", json=spec).json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["failure_reason"]
    losses = dict(zip(*client.get(f"/v1/jobs/{job['id']}/metrics", params={"names": "eval_loss"}).json()["series"]["eval_loss"].values()))
    best = min(losses, key=losses.get)
    assert best < 240 and losses[240] > losses[best]
    listed = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()
    assert [(c["step"], c["eval_loss"], c["best"]) for c in listed] == [(best, losses[best], True), (240, losses[240], False)]

    assert main(["checkpoints", str(job["id"]), "--server", info.url, "--token", info.token]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [str(best), f"{losses[best]:.4f}", "best"] in [row[1:4] for row in rows]
    weights = safetensors_load(client.get(f"/v1/checkpoints/{listed[0]['id']}/download").content)
    assert weights.keys() == final_weights(client, job["id"]).keys()
    assert any(not torch.equal(weights[name], tensor) for name, tensor in final_weights(client, job["id"]).items())


@ON_ONE_BACKEND
def test_a_crashing_job_fails_with_the_reason_and_its_last_output(stack):
    client, info = stack
    # Too short for one step of 4 windows of 16 characters, which only the training can tell: its 80
    # bytes (what admission sees) are 40 two-byte characters. A corpus shorter in bytes is a 422 at submit.
    (info.data_dir / "data" / "tiny.txt").write_text("é" * 40)
    assert client.post("/v1/jobs", json=tiny_spec(**{"dataset.path": "tiny.txt", "model.block_size": 64})).status_code == 422
    job_id = client.post("/v1/jobs", json=tiny_spec(**{"dataset.path": "tiny.txt", "max_restarts": 1})).json()["id"]
    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
    assert job["status"] == "failed"
    assert [a["status"] for a in job["attempts"]] == ["failed"]  # the spec's own failure: a retry would fail the same
    assert "not retried: invalid job spec" in job["failure_reason"] and "too few to fill" in job["failure_reason"], job
    logs = client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 200}).json()["lines"]
    assert any("too few to fill" in line["line"] for line in logs)  # the training process's own error


def test_cancel_stops_a_running_job_and_frees_its_host(stack):
    client, _ = stack
    job_id = client.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 100_000, "checkpoint.every_steps": 100_000})).json()["id"]
    wait_for_step(client, job_id, 3, timeout=120)
    client.post(f"/v1/jobs/{job_id}/cancel")
    job = wait_for(client, job_id, {"cancelled", "failed", "succeeded"}, timeout=60)
    assert job["status"] == "cancelled" and job["attempts"][-1]["status"] == "cancelled"
    assert client.get("/v1/workers").json()[0]["busy_slots"] == 0


@ON_ONE_BACKEND
def test_a_cancel_that_comes_after_the_last_step_leaves_the_finished_run_succeeded(stack):
    # Found by a new user: a job cancelled (and a sweep's trial pruned) once it had reported its
    # last step, as it wrote its last checkpoint, ended cancelled at 2000/2000.
    client, info = stack
    shutil.copy(Path(__file__).parent / "plugins" / "labels_classifier.py", info.data_dir / "plugins")
    write_labelled_jsonl(info.data_dir / "data" / "labels.jsonl")
    spec = classifier_spec(**{"training.max_steps": 20, "checkpoint.every_steps": 20})
    spec["model"] = {"kind": "custom", "entrypoint": "labels_classifier:train", "config": {"linger_s": 8}}
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    wait_for_step(client, job_id, 20)  # its last: the loop lingers, its last checkpoint still to be finished
    client.post(f"/v1/jobs/{job_id}/cancel")
    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=60)
    assert job["status"] == "succeeded" and job["attempts"][-1]["status"] == "succeeded", job
    assert [c["step"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json()] == [20]


@ON_ONE_BACKEND
def test_a_classifier_job_reports_eval_accuracy_and_its_checkpoint_carries_the_labels(stack):
    client, info = stack
    write_labelled_jsonl(info.data_dir / "data" / "labels.jsonl")
    spec = classifier_spec(**{"training.max_steps": 40, "training.eval_every": 20, "optimizer.lr": 0.01})
    job = wait_for(client, client.post("/v1/jobs", json=spec).json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["failure_reason"]
    series = client.get(f"/v1/jobs/{job['id']}/metrics", params={"names": "eval_accuracy,train_loss"}).json()["series"]
    assert series["eval_accuracy"]["steps"] == [20, 40] and series["eval_accuracy"]["values"][-1] > 0.8
    latest = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()[-1]
    tar = client.get(f"/v1/checkpoints/{latest['id']}/download", params={"format": "tar"}).content
    labels = tarfile.open(fileobj=io.BytesIO(tar)).extractfile(f"job{job['id']}-step40/labels.json").read()
    assert json.loads(labels) == ["first", "second", "third"]


@ON_ONE_BACKEND
def test_a_loss_spike_is_rolled_back_past_its_batches_and_the_job_ends_as_one_without_them(stack):
    """Labels swapped in the batches of steps 31-33 (training/test_guard.py's data): the job rolls
    back once, to its checkpoint at 30, and ends with the weights of a job on the data without them."""
    client, info = stack
    poisoned, reference = rolled_back_once_against_a_run_without_the_window(client, info, guarded_classifier_spec)
    spiked, resumed = poisoned["attempts"]
    assert spiked["status"] == "preempted" and "loss guard" in spiked["failure_reason"] and resumed["resumed_from_step"] == 30
    # Each step's metrics once, the second run's.
    losses = client.get(f"/v1/jobs/{poisoned['id']}/metrics", params={"names": "train_loss"}).json()["series"]["train_loss"]
    expected = client.get(f"/v1/jobs/{reference['id']}/metrics", params={"names": "train_loss"}).json()["series"]["train_loss"]
    assert losses["steps"] == list(range(1, 61)) and losses["values"][30:] == pytest.approx(expected["values"][30:], abs=1e-6)


def rolled_back_once_against_a_run_without_the_window(client: httpx.Client, info, spec_for) -> tuple[dict, dict]:
    """Labels swapped in the batches of steps 31-33: `spec_for("poisoned.jsonl")` rolls back once, to
    its checkpoint at 30, its checkpoints past it dropped, and ends with the weights of
    `spec_for("without.jsonl")`, run beside it. Both jobs, ended."""
    write_poisoned_labels(info.data_dir / "data", range(31, 34), batch=8)
    poisoned_id = client.post("/v1/jobs", json=spec_for("poisoned.jsonl")).json()["id"]
    reference_id = client.post("/v1/jobs", json=spec_for("without.jsonl")).json()["id"]
    poisoned = wait_for(client, poisoned_id, {"succeeded", "failed", "cancelled"})
    reference = wait_for(client, reference_id, {"succeeded", "failed", "cancelled"})
    assert poisoned["status"] == reference["status"] == "succeeded", (poisoned["failure_reason"], reference["failure_reason"])
    assert (poisoned["rollbacks"], poisoned["restarts"], reference["rollbacks"]) == (1, 0, 0)
    [mark] = poisoned["rollback_marks"]
    assert (mark["first_step"], mark["last_step"], mark["resume_step"]) == (31, 33, 30)
    assert poisoned["attempts"][-1]["resumed_from_step"] == 30
    assert [c["step"] for c in client.get(f"/v1/jobs/{poisoned_id}/checkpoints").json()] == [10, 20, 30, 40, 50, 60]
    ours, theirs = final_weights(client, poisoned_id), final_weights(client, reference_id)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6)
    return poisoned, reference


@ON_ONE_BACKEND
def test_a_custom_loops_spike_is_rolled_back_and_its_context_has_it_skip_the_batches(stack):
    """The same poisoned data, a custom loop fed by a loader (tests/e2e/plugins/labels_classifier.py):
    its worker sees the spike in what it logs, and the job resumes from step 30 with the context
    saying 3 steps' batches to pass over; it ends with the weights of the loop on the data without them."""
    client, info = stack
    shutil.copy(Path(__file__).parent / "plugins" / "labels_classifier.py", info.data_dir / "plugins")

    def custom(path: str) -> dict:
        return {**guarded_classifier_spec(path), "model": {"kind": "custom", "entrypoint": "labels_classifier:train"}}

    rolled_back_once_against_a_run_without_the_window(client, info, custom)


@ON_ONE_BACKEND
def test_the_gan_example_runs_as_a_custom_job_and_its_checkpoint_downloads_with_both_models(stack):
    client, _ = stack  # an embedded stack installs examples/plugins
    spec = json.loads((Path(__file__).resolve().parents[2] / "examples" / "gan.json").read_text())
    spec["training"]["max_steps"], spec["checkpoint"]["every_steps"] = 100, 50
    job = wait_for(client, client.post("/v1/jobs", json=spec).json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["failure_reason"]
    assert job["step"] == 100
    series = client.get(f"/v1/jobs/{job['id']}/metrics").json()["series"]
    own = {name for name in series if not name.startswith("sys/")}  # the worker's samples of the machine beside them
    assert own == {"d_loss", "g_loss"} and series["g_loss"]["steps"] == list(range(1, 101))
    checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()
    assert [c["step"] for c in checkpoints] == [50, 100]
    response = client.get(f"/v1/checkpoints/{checkpoints[-1]['id']}/download")
    assert hashlib.sha256(response.content).hexdigest() == checkpoints[-1]["sha256"]
    names = {name.split(".")[0] for name in safetensors_load(response.content)}
    assert names == {"generator", "discriminator"}


@ON_ONE_BACKEND
def test_a_rerun_from_the_run_record_trains_the_same_weights_and_refuses_a_changed_dataset(stack, capsys):
    client, info = stack
    corpus = info.data_dir / "data" / "rerun.txt"
    corpus.write_text(CORPUS.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    spec = tiny_spec(**{"name": "rerun-me", "dataset.path": corpus.name})
    first = wait_for(client, client.post("/v1/jobs", json=spec).json()["id"], {"succeeded", "failed", "cancelled"})
    assert first["status"] == "succeeded", first["failure_reason"]

    # Its record: the dataset's digest as the worker read it, the packages the training ran with, the device.
    record = client.get(f"/v1/jobs/{first['id']}/record").json()
    [attempt] = record["attempts"]
    environment = attempt["environment"]
    assert environment["inputs"] == {corpus.name: hashlib.sha256(corpus.read_bytes()).hexdigest()}
    assert environment["packages"]["torch"] == importlib.metadata.version("torch") and environment["device"].startswith("cpu: ")
    assert environment["cpu_threads"] >= 1  # its sums' order: weights match bit for bit only with the same

    # `trainyard rerun`: the same weights, bit for bit; `trainyard diff` finds nothing that differs.
    cli = ["--server", info.url, "--token", info.token]
    assert main(["rerun", str(first["id"]), "--follow", *cli]) == 0
    rerun_id = int(capsys.readouterr().out.split("submitted job ")[1].split()[0])
    weights, again = final_weights(client, first["id"]), final_weights(client, rerun_id)
    assert weights.keys() == again.keys() and all(torch.equal(weights[name], again[name]) for name in weights)
    assert main(["diff", str(first["id"]), str(rerun_id), *cli]) == 0
    assert "ran the same spec on the same inputs, packages and kind of device" in capsys.readouterr().out

    # The dataset changed since: a rerun fails at once, naming it, and is not retried.
    corpus.write_text(corpus.read_text(encoding="utf-8").replace("the", "THE"), encoding="utf-8")
    assert main(["rerun", str(first["id"]), "--follow", *cli]) == 1
    failed = client.get(f"/v1/jobs/{int(capsys.readouterr().out.split('submitted job ')[1].split()[0])}").json()
    assert failed["status"] == "failed" and len(failed["attempts"]) == 1, failed
    assert f"input {corpus.name} changed since the job it reruns" in failed["failure_reason"], failed["failure_reason"]
    assert main(["diff", str(first["id"]), str(failed["id"]), *cli]) == 0
    assert f"inputs.{corpus.name}" in capsys.readouterr().out  # its attempt reported what it found
    assert main(["diff", str(first["id"]), str(failed["id"]), "--json", *cli]) == 0
    differences = {row["what"]: (row["first"], row["second"]) for row in json.loads(capsys.readouterr().out)}
    assert differences[f"inputs.{corpus.name}"][0] == environment["inputs"][corpus.name]
