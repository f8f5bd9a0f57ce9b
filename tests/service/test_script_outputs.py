"""A script job's outputs (`script.outputs`) in the store and through the API (SQLite and PostgreSQL):
copied with a manifest, links and special files left out; the latest collection of a name replaces
the one before; downloaded as a tar that unpacks and verifies; another user's are 404. And the
supervisor's side: a checkpoint is progress to the stall watch, and queues the outputs when asked."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from api_schemas import AttemptStatus, JobSpec
from api_schemas.manifest import MANIFEST_FILE, verify_manifest
from api_schemas.worker_protocol import CheckpointEvent, InvalidSpecEvent, encode_event
from common.artifacts import ArtifactStore
from service.db.accounts import create_user
from service.db.outputs import record_output
from service.db.session import session_factory
from common.settings import Settings
from tests.helpers import auth, start_job, tiny_spec
from workers.job_paths import copy_out, handover_directory
from workers.launch import EVENTS_FILE_NAME
from workers.supervisor import FinalReason, RunningAttempt


@pytest.fixture
def tokens(settings) -> dict[str, str]:
    with session_factory(settings.resolved_database_url)() as session:
        return {"alice": create_user(session, "alice")[1], "bob": create_user(session, "bob")[1]}


def write_output(directory: Path, weights: bytes) -> Path:
    (directory / "sub").mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "sub" / MANIFEST_FILE).write_text("the script's own file of that name")
    (directory / "passwd").symlink_to("/etc/passwd")
    os.mkfifo(directory / "pipe")
    return directory


def test_an_output_is_stored_beside_its_manifest_without_links_or_special_files(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    source = write_output(tmp_path / "code" / "out", b"w" * 100)
    relative, sha256, size, files = store.ingest_output(source, job_id=7, name="out", step=40)
    stored = store.path(relative)
    manifest = verify_manifest(stored)
    assert manifest["step"] == 40
    assert sorted(manifest["files"]) == ["out/model.safetensors", f"out/sub/{MANIFEST_FILE}"]
    assert (size, files) == (100 + len("the script's own file of that name"), 2)
    assert not (stored / "out" / "passwd").exists() and not (stored / "out" / "pipe").exists()
    assert source.is_dir()  # the script's directory is copied, not taken


def test_the_workers_copy_of_an_output_is_moved_in_as_its_only_copy(tmp_path):
    """The worker copies an output out of the job's reach once; the store takes that copy whole (a
    rename on its filesystem), under a name of several parts as the spec gives it."""
    run_dir = tmp_path / "attempt"
    source = write_output(run_dir / "code" / "results" / "final", b"w" * 100)
    folder = copy_out(run_dir, source, "results/final", max_bytes=2**20)
    inode = (folder / "results" / "final" / "model.safetensors").stat().st_ino
    store = ArtifactStore(tmp_path / "store")
    relative, sha256, size, files = store.hand_over_output(folder, job_id=7, step=40)
    stored = store.path(relative)
    assert sorted(verify_manifest(stored)["files"]) == ["results/final/model.safetensors", f"results/final/sub/{MANIFEST_FILE}"]
    assert (stored / "results" / "final" / "model.safetensors").stat().st_ino == inode  # moved, not copied again
    assert not folder.exists() and source.is_dir()


def test_the_latest_collection_replaces_the_one_before_and_downloads_whole_to_its_owner_only(api, tokens, settings, tmp_path):
    job_id = api.post("/v1/jobs", json=tiny_spec(), headers=auth(tokens["alice"])).json()["id"]
    claimed = start_job(settings, job_id)
    store = ArtifactStore(settings.resolved_artifact_root)
    sessions = session_factory(settings.resolved_database_url)
    collections = []
    for step, weights in [(20, b"first"), (40, b"second")]:
        relative, sha256, size, files = store.ingest_output(write_output(tmp_path / f"at-{step}" / "out", weights), job_id, "out", step)
        with sessions() as session:
            collections.append(record_output(session, job_id, claimed.attempt_id, "out", step, relative, sha256, size, files))
    assert collections[0] is None and collections[1] is not None  # the first is the one to delete

    [listed] = api.get(f"/v1/jobs/{job_id}/outputs", headers=auth(tokens["alice"])).json()
    assert (listed["name"], listed["step"], listed["sha256"], listed["files"]) == ("out", 40, sha256, 2)
    response = api.get(f"/v1/jobs/{job_id}/outputs/out", headers=auth(tokens["alice"]))
    assert response.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    verify_manifest(tmp_path / "unpacked" / f"job{job_id}-output")
    assert (tmp_path / "unpacked" / f"job{job_id}-output" / "out" / "model.safetensors").read_bytes() == b"second"

    for path in ["/outputs", "/outputs/out"]:
        assert api.get(f"/v1/jobs/{job_id}{path}", headers=auth(tokens["bob"])).status_code == 404
    assert api.get(f"/v1/jobs/{job_id}/outputs/elsewhere", headers=auth(tokens["alice"])).status_code == 404


def script_attempt(tmp_path: Path, command: tuple[str, ...] = ("true",), resources: dict | None = None, **script) -> RunningAttempt:
    spec = JobSpec.model_validate({
        "name": "saves-only", "training": {"stall_timeout_s": 60}, "resources": resources or {},
        "script": {"entrypoint": "train.py", "code": {"path": "code"}, **script},
    })
    run_dir = tmp_path / "attempt-1"
    (run_dir / "code" / "out").mkdir(parents=True)
    claimed = SimpleNamespace(job_id=1, number=1, node_rank=0, resume_step=None, device_ids=None)
    runner = SimpleNamespace(settings=Settings(data_dir=tmp_path), shutting_down=threading.Event())  # what of the worker's runner the attempt reads here
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, start_new_session=True)
    return RunningAttempt(runner, claimed, spec, run_dir.resolve(), process)


def test_a_checkpoint_is_progress_to_the_stall_watch_and_collects_the_outputs_when_asked(tmp_path):
    attempt = script_attempt(tmp_path, outputs=["out", "never-written"], outputs_at_checkpoints=True)
    before = attempt.stall.last_progress
    time.sleep(0.01)
    checkpoint = attempt.run_dir / "code" / "step_50"
    checkpoint.mkdir(parents=True)
    (attempt.run_dir / EVENTS_FILE_NAME).write_text(encode_event(CheckpointEvent(step=50, path=checkpoint)))
    attempt._take_events()
    assert attempt.stall.last_progress > before
    # Moved out of the job's reach at once (workers/job_paths.py), under the folder name it was saved as.
    [(handed, step, folder)] = attempt.outbox.checkpoints.items
    assert step == 50 and folder.endswith("/step_50") and handed.parent == handover_directory(attempt.run_dir) and not checkpoint.exists()
    assert attempt.outbox.outputs.items == [(attempt.run_dir / "code" / "out", "out", 50)]
    [(_, rank, line)] = attempt.outbox.logs
    assert rank is None and line == "trainyard: output 'never-written' not collected: no such directory in the working directory"


def test_a_spec_the_training_found_it_cannot_run_fails_the_attempt_for_good(tmp_path):
    attempt = script_attempt(tmp_path)
    (attempt.run_dir / EVENTS_FILE_NAME).write_text(encode_event(InvalidSpecEvent(message="training.micro_batch_size: too few")))
    attempt._take_events()
    attempt.exit_code = 2
    status, reason = attempt._outcome()
    assert status == AttemptStatus.failed and isinstance(reason, FinalReason)  # finished with retry=False
    assert reason == "invalid job spec: training.micro_batch_size: too few"


def test_an_attempt_past_its_max_runtime_is_stopped_and_fails_for_good(tmp_path):
    attempt = script_attempt(tmp_path, ("sleep", "600"), resources={"max_runtime_hours": 0.0001})  # 0.36 s
    time.sleep(0.5)
    attempt._stop_if_over_limits()
    attempt.exit_code = attempt.process.wait(5)
    status, reason = attempt._outcome()
    assert status == AttemptStatus.failed and isinstance(reason, FinalReason)
    assert reason.startswith("max runtime: ran 0.0001 h (resources.max_runtime_hours"), reason
