"""A worker host that doesn't mount the artifact store (TRAINYARD_SHARED_ARTIFACT_STORE=false, its
own artifact root an empty directory elsewhere), on PostgreSQL + Redis: its checkpoints and a
script's outputs reach the store through the API, verified; an attempt killed mid-run resumes from
a checkpoint fetched back through the API, bit-identical to a run never interrupted; its dataset and
a script's code come through the API too. Nothing is ever written to the host's own artifact root
or data root.
(The transfers' cuts and refusals: tests/service/test_host_transfers.py.)"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import tarfile

import httpx
import pytest

from stack.embedded import embedded_stack
from tests.e2e.test_end_to_end import wait_for
from tests.e2e.test_faults import assert_same_run, run_reference, training_ranks, wait_until_training
from tests.e2e.test_scripts import EXAMPLES, TINY_GPT, kill_after_its_first_checkpoint, script_spec
from tests.helpers import small_spec
from workers.launch import attempt_dir
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, module_postgres_url, module_redis_url):
    yard = tmp_path_factory.mktemp("far") / "yard"
    hosts_own = tmp_path_factory.mktemp("far-host") / "artifacts"  # where this host would keep a store: never written
    hosts_data = tmp_path_factory.mktemp("far-host-data")  # and its data root: empty, every dataset comes through the API
    far = {"TRAINYARD_SHARED_ARTIFACT_STORE": "false", "TRAINYARD_ARTIFACT_ROOT": str(hosts_own), "TRAINYARD_DATA_ROOT": str(hosts_data)}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
        with embedded_stack(
            yard, free_port(), workers=1, devices="cpu:2", database_url=module_postgres_url, broker_url=module_redis_url, worker_settings=far,
        ) as info:
            with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
                yield client, info
    assert not hosts_own.exists() or not any(hosts_own.rglob("*")), list(hosts_own.rglob("*"))
    assert not any(hosts_data.rglob("*")), list(hosts_data.rglob("*"))


# test_faults' job, with fewer checkpoints: what is fetched and sent is the same few files whatever the steps.
SPEC = small_spec(**{
    "training.max_steps": 200, "training.eval_every": 100, "schedule.warmup_steps": 10,
    "checkpoint.every_steps": 25, "checkpoint.keep_last": 10, "max_restarts": 2,
})


def test_a_job_killed_mid_run_resumes_from_a_checkpoint_fetched_through_the_api_bit_identical(stack):
    client, info = stack
    # The job and its uninterrupted reference train side by side, a slot each.
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    reference = client.post("/v1/jobs", json=SPEC).json()["id"]

    # Its training killed once a checkpoint is listed: the next attempt fetches that checkpoint back.
    wait_until_training(client, job_id, SPEC)
    for pid in training_ranks(attempt_dir(info.data_dir / "work", job_id, 1)):
        os.kill(pid, signal.SIGKILL)

    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["failure_reason"]
    first, second = job["attempts"]
    assert first["status"] == "failed" and second["resumed_from_step"] >= SPEC["checkpoint"]["every_steps"]
    assert_same_run(client, job_id, run_reference(client, SPEC, reference_id=reference), SPEC["training"]["max_steps"])
    # Its dataset came through the API (this host's data root is empty): the record names what the service holds.
    corpus = SPEC["dataset"]["path"]
    for attempt in client.get(f"/v1/jobs/{job_id}/record").json()["attempts"]:
        assert attempt["environment"]["inputs"] == {corpus: hashlib.sha256((info.data_dir / "data" / corpus).read_bytes()).hexdigest()}
    for checkpoint in client.get(f"/v1/jobs/{job_id}/checkpoints").json():  # each listed one verified, and whole
        weights = client.get(f"/v1/checkpoints/{checkpoint['id']}/download").content
        assert hashlib.sha256(weights).hexdigest() == checkpoint["sha256"]


def test_a_script_gets_its_code_and_resume_through_the_api_and_its_outputs_arrive(stack, tmp_path):
    client, info = stack
    bundle = io.BytesIO()
    with tarfile.open(fileobj=bundle, mode="w:gz") as tar:
        tar.add(EXAMPLES / "char_gpt.py", arcname="char_gpt.py")
        notes = tmp_path / "notes.txt"
        notes.write_text("kept with the run\n")
        tar.add(notes, arcname="notes/notes.txt")
    uploaded = client.post("/v1/code", params={"name": "bundle.tgz"}, content=bundle.getvalue(), headers={"Content-Type": "application/octet-stream"})
    args = ["--max_steps", "300", "--checkpoint_every", "50", *TINY_GPT]
    spec = script_spec("far-script", "char_gpt.py", args, {"upload_id": uploaded.json()["id"]}, max_restarts=1)
    spec["script"]["outputs"] = ["notes"]
    job_id = client.post("/v1/jobs", json=spec).json()["id"]

    # Killed after its first checkpoint: the resume is the script's own folder, fetched through the API.
    kill_after_its_first_checkpoint(info.data_dir, job_id)

    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["failure_reason"]
    first, second = job["attempts"]
    assert first["status"] == "failed" and second["resumed_from_step"] >= 50
    steps = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss"}).json()["series"]["train_loss"]["steps"]
    assert steps == list(range(1, 301))
    logs = client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 1000}).json()["lines"]
    assert any(f"at step {second['resumed_from_step']}" in line["line"] for line in logs if line["attempt"] == 2)

    [output] = client.get(f"/v1/jobs/{job_id}/outputs").json()
    assert (output["name"], output["files"]) == ("notes", 1)
    with tarfile.open(fileobj=io.BytesIO(client.get(f"/v1/jobs/{job_id}/outputs/notes").content)) as tar:
        [member] = [m for m in tar.getmembers() if m.name.endswith("notes.txt")]
        assert tar.extractfile(member).read() == b"kept with the run\n"
