"""Client.download and `trainyard download` against the real API app, served by uvicorn on SQLite,
from a checkpoint in the real artifact store: verification, Range resume, a dropped connection,
corruption at rest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from api_schemas.manifest import MODEL_FILE, write_manifest
from service.api.main import create_app
from common.artifacts import ArtifactStore
from service.db.accounts import user_by_name
from service.db.checkpoints import list_checkpoints, record_checkpoint
from service.db.jobs import create_job
from service.db.session import session_factory
from common.settings import Settings
from tests.client.serve import serve_app
from tests.helpers import job_spec, start_job
from trainyard.cli import main
from trainyard.client import Client, TrainyardError

CUT_AFTER = 100_000


class DownloadTap:
    """The real app, recording the Range header of every download request; with `cut`, a download
    asked for without Range breaks off after CUT_AFTER bytes of its body, as a dropped connection would."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.ranges: list[str | None] = []
        self.cut = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/download"):
            return await self.app(scope, receive, send)
        byte_range = dict(scope["headers"]).get(b"range")
        self.ranges.append(byte_range.decode() if byte_range else None)
        if not self.cut or byte_range:
            return await self.app(scope, receive, send)
        sent = 0

        async def send_then_break(message) -> None:
            nonlocal sent
            if message["type"] == "http.response.body":
                body = message.get("body", b"")[: CUT_AFTER - sent]
                sent += len(body)
                await send({**message, "body": body, "more_body": True})
                if sent >= CUT_AFTER:
                    raise ConnectionAbortedError("the connection drops")  # uvicorn closes it mid-response
                return
            await send(message)

        await self.app(scope, receive, send_then_break)


@pytest.fixture
def stored(settings: Settings, token, tmp_path, model_bytes) -> int:
    """The id of a checkpoint of alice's job: written as the loop writes one, taken into the
    artifact store and recorded as the worker does."""
    with session_factory(settings.resolved_database_url)() as session:
        job = create_job(session, user_by_name(session, "alice"), job_spec())
    claimed = start_job(settings, job.id)
    written = tmp_path / "run" / "step-00000012"
    written.mkdir(parents=True)
    (written / MODEL_FILE).write_bytes(model_bytes)
    write_manifest(written, 12)
    relative, sha256, size = ArtifactStore(settings.resolved_artifact_root).ingest_checkpoint(written, job.id, 12)
    with session_factory(settings.resolved_database_url)() as session:
        record_checkpoint(session, job.id, claimed.attempt_id, 12, relative, sha256, size, keep_last=2)
        [checkpoint] = list_checkpoints(session, job.id)
    return checkpoint.id


@pytest.fixture
def api(settings, token, stored):
    tap = DownloadTap(create_app(settings))
    with serve_app(tap) as url, Client(url, token) as client:
        yield client, tap, url


def test_download_verifies_and_renames_the_file(api, stored, tmp_path, model_bytes):
    client, tap, _ = api
    seen = []
    dest = client.download(stored, tmp_path / "out" / "model.safetensors", progress=lambda done, total: seen.append((done, total)))
    assert dest.read_bytes() == model_bytes
    assert not dest.with_name("model.safetensors.part").exists()
    assert seen[-1] == (len(model_bytes), len(model_bytes))
    assert tap.ranges == [None]


def test_a_download_into_a_directory_lands_inside_it_and_onto_a_device_or_pipe_is_refused(api, stored, tmp_path, model_bytes):
    client, tap, _ = api
    assert client.download(stored, tmp_path).read_bytes() == model_bytes
    assert (tmp_path / f"checkpoint-{stored}.safetensors").is_file()
    # `-o /dev/null` once renamed the verified file over the machine's /dev/null.
    pipe = tmp_path / "a-pipe"
    os.mkfifo(pipe)
    for special in (pipe, Path("/dev/null")):
        with pytest.raises(TrainyardError, match="is not a regular file"):
            client.download(stored, special)
    assert pipe.exists() and not pipe.is_file() and Path("/dev/null").is_char_device()
    with pytest.raises(TrainyardError, match="is not a directory"):
        client.download_state(stored, pipe)


def test_download_resumes_a_truncated_part_file(api, stored, tmp_path, model_bytes):
    client, tap, _ = api
    dest = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.part").write_bytes(model_bytes[:100_000])
    seen = []
    client.download(stored, dest, progress=lambda done, total: seen.append((done, total)))
    assert dest.read_bytes() == model_bytes
    assert tap.ranges == ["bytes=100000-"]  # only the rest was fetched
    assert seen[-1] == (len(model_bytes), len(model_bytes))


def test_an_interrupted_download_keeps_its_part_file_and_resumes(api, stored, tmp_path, model_bytes):
    client, tap, _ = api
    tap.cut = True
    dest = tmp_path / "model.safetensors"
    with pytest.raises(TrainyardError, match="model.safetensors.part is kept: run the download again to resume"):
        client.download(stored, dest)
    assert (tmp_path / "model.safetensors.part").read_bytes() == model_bytes[:CUT_AFTER]
    client.download(stored, dest)
    assert dest.read_bytes() == model_bytes
    assert tap.ranges == [None, f"bytes={CUT_AFTER}-"]


def test_a_part_file_longer_than_the_checkpoint_is_downloaded_again(api, stored, tmp_path, model_bytes):
    client, tap, _ = api
    dest = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.part").write_bytes(b"x" * (len(model_bytes) + 10))
    client.download(stored, dest)
    assert dest.read_bytes() == model_bytes
    assert tap.ranges == [f"bytes={len(model_bytes) + 10}-", None]  # 416, then from the start


def test_a_checkpoint_corrupted_at_rest_is_an_error_and_leaves_no_file(api, stored, settings, tmp_path):
    client, _, _ = api
    [weights] = settings.resolved_artifact_root.rglob(MODEL_FILE)
    corrupted = bytearray(weights.read_bytes())
    corrupted[1000] ^= 0xFF  # one flipped bit on the store's disk, after it was verified and recorded
    weights.write_bytes(bytes(corrupted))
    dest = tmp_path / "model.safetensors"
    with pytest.raises(TrainyardError, match="sha256 mismatch.*corrupt"):
        client.download(stored, dest)
    assert not dest.exists() and not (tmp_path / "model.safetensors.part").exists()


def test_a_corrupt_resumed_prefix_fails_verification(api, stored, tmp_path):
    client, _, _ = api
    (tmp_path / "model.safetensors.part").write_bytes(b"\0" * 1000)
    with pytest.raises(TrainyardError, match="sha256 mismatch"):
        client.download(stored, tmp_path / "model.safetensors")


def test_the_download_command_writes_the_verified_file(api, stored, token, tmp_path, model_bytes, monkeypatch, capsys):
    _, _, url = api
    monkeypatch.setenv("TRAINYARD_SERVER", url)
    monkeypatch.setenv("TRAINYARD_TOKEN", token)
    dest = tmp_path / "model.safetensors"
    assert main(["download", str(stored), "-o", str(dest)]) == 0
    assert capsys.readouterr().out == f"saved {dest} (sha256 verified)\n"
    assert dest.read_bytes() == model_bytes
