"""Downloading a checkpoint's whole state (Client.download_state, `trainyard download --state`) from the real API app."""

from __future__ import annotations

import hashlib

import pytest

from api_schemas.manifest import MODEL_FILE, checkpoint_name, write_manifest
from service.api.main import create_app
from service.db.accounts import create_user
from service.db.checkpoints import list_checkpoints, record_checkpoint
from service.db.jobs import create_job
from service.db.session import session_factory
from tests.client.serve import serve_app
from tests.helpers import job_spec, start_job
from trainyard.client import Client, TrainyardError


@pytest.fixture
def stored(settings):
    """(settings, alice's token, record(files) → checkpoint id of a checkpoint holding `files`)."""
    sessions = session_factory(settings.resolved_database_url)
    with sessions() as session:
        alice, token = create_user(session, "alice")
        job_id = create_job(session, alice, job_spec()).id
    claimed = start_job(settings, job_id)

    def record(step: int, files: dict[str, bytes]) -> int:
        relative = f"jobs/{job_id}/checkpoints/{checkpoint_name(step)}"
        directory = settings.resolved_artifact_root / relative
        for name, content in files.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(content)
        write_manifest(directory, step)
        with sessions() as session:
            record_checkpoint(session, job_id, claimed.attempt_id, step, relative, "0" * 64, 1, keep_last=10)
            return list_checkpoints(session, job_id)[-1].id

    return settings, token, record


def test_the_whole_state_arrives_unpacked_and_verified_against_its_manifest(stored, tmp_path):
    settings, token, record = stored
    files = {MODEL_FILE: b"weights", "state/optimizer.bin": b"adam" * 1000, "trainer_state.json": b'{"step": 12}'}
    checkpoint_id = record(12, files)
    with serve_app(create_app(settings)) as url, Client(url, token) as client:
        directory = client.download_state(checkpoint_id, tmp_path / "out")
        assert {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()} == set(files) | {"manifest.json"}
        assert all((directory / name).read_bytes() == content for name, content in files.items())
        # Again into the same place: refused, the first left as it was (unpacked over it, another
        # download's files would have stayed beside this one's).
        (directory / "notes.txt").write_text("mine")
        with pytest.raises(TrainyardError, match=f"{directory} exists already"):
            client.download_state(checkpoint_id, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [directory.name] and (directory / "notes.txt").read_text() == "mine"


def test_a_state_that_does_not_match_its_manifest_is_refused_and_removed(stored, tmp_path):
    settings, token, record = stored
    checkpoint_id = record(12, {MODEL_FILE: b"weights"})
    (settings.resolved_artifact_root / f"jobs/1/checkpoints/step-00000012/{MODEL_FILE}").write_bytes(b"tampered")
    with serve_app(create_app(settings)) as url, Client(url, token) as client:
        with pytest.raises(TrainyardError, match="corrupt"):
            client.download_state(checkpoint_id, tmp_path / "out")
    assert not any((tmp_path / "out").iterdir())


def test_a_checkpoint_without_weights_names_the_way_to_get_it(stored, tmp_path):
    settings, token, record = stored
    checkpoint_id = record(20, {"state/model.bin": b"a script's own format"})  # what a script's save_state wrote
    with serve_app(create_app(settings)) as url, Client(url, token) as client:
        with pytest.raises(TrainyardError, match=f"trainyard download {checkpoint_id} --state"):
            client.download(checkpoint_id, tmp_path / "weights.safetensors")
        directory = client.download_state(checkpoint_id, tmp_path / "out")
    assert hashlib.sha256((directory / "state/model.bin").read_bytes()).hexdigest() == hashlib.sha256(b"a script's own format").hexdigest()
