"""The artifact store admits only complete, verified checkpoints, and only inside its root."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from api_schemas.manifest import MODEL_FILE, CorruptCheckpoint, sha256_file, verify_manifest, write_manifest
from common.artifacts import ArtifactStore
from tests.helpers import directory_on_another_filesystem


def make_checkpoint(directory, step=10):
    (directory / "state").mkdir(parents=True)
    (directory / MODEL_FILE).write_bytes(b"weights" * 100)
    (directory / "state" / "optimizer.bin").write_bytes(b"optimizer")
    write_manifest(directory, step)
    return directory


def test_a_complete_checkpoint_on_the_same_filesystem_is_moved_in_not_copied(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    source = make_checkpoint(tmp_path / "run" / "step-10")
    inode = (source / MODEL_FILE).stat().st_ino
    relative, sha256, size = store.ingest_checkpoint(source, job_id=7, step=10)
    assert relative == "jobs/7/checkpoints/step-00000010"
    assert (store.path(relative) / "state" / "optimizer.bin").read_bytes() == b"optimizer"
    assert size == 700 and sha256 == sha256_file(store.path(relative) / MODEL_FILE)
    assert not source.exists() and (store.path(relative) / MODEL_FILE).stat().st_ino == inode  # no byte written twice


def bytes_read_by_this_process() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts reads with Linux's /proc/self/io")
def test_a_moved_checkpoint_is_not_read_again_unless_a_file_changed_after_its_manifest(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    weights = os.urandom(8 << 20)
    untouched, rewritten = tmp_path / "run" / "step-10", tmp_path / "run" / "step-20"
    for source in (untouched, rewritten):
        (source / "state").mkdir(parents=True)
        (source / MODEL_FILE).write_bytes(weights)
        write_manifest(source, 10)
    (rewritten / MODEL_FILE).write_bytes(weights)  # the same bytes, written after the manifest

    before = bytes_read_by_this_process()
    store.ingest_checkpoint(untouched, job_id=7, step=10)
    assert bytes_read_by_this_process() - before < 1 << 20  # the manifest, not the 8 MB its writer hashed
    before = bytes_read_by_this_process()
    store.ingest_checkpoint(rewritten, job_id=7, step=20)
    assert bytes_read_by_this_process() - before >= len(weights)  # hashed again, and it still matches


def test_a_checkpoint_on_another_filesystem_is_copied_in_and_left_to_its_writer(tmp_path):
    with directory_on_another_filesystem(than=tmp_path) as elsewhere:
        source = make_checkpoint(elsewhere / "step-10")
        store = ArtifactStore(tmp_path / "store")
        relative, _, size = store.ingest_checkpoint(source, job_id=7, step=10)
        assert size == 700 and (store.path(relative) / MODEL_FILE).read_bytes() == (source / MODEL_FILE).read_bytes()
        assert verify_manifest(store.path(relative))


def test_a_checkpoint_stored_before_a_retry_is_described_again_without_its_source(tmp_path):
    # The database missed the first record_checkpoint: the worker retries with the source moved away.
    store = ArtifactStore(tmp_path / "store")
    source = make_checkpoint(tmp_path / "run" / "step-10")
    first = store.ingest_checkpoint(source, job_id=7, step=10)
    assert not source.exists() and store.ingest_checkpoint(source, job_id=7, step=10) == first
    with pytest.raises(CorruptCheckpoint, match="is gone"):
        store.ingest_checkpoint(source, job_id=7, step=20)


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_manifest"])
def test_a_partial_or_corrupt_checkpoint_never_enters_the_store(tmp_path, damage):
    source = make_checkpoint(tmp_path / "run" / "step-10")
    if damage == "truncate":  # killed while writing
        (source / "state" / "optimizer.bin").write_bytes(b"opt")
    elif damage == "flip":
        (source / MODEL_FILE).write_bytes(b"X" + (source / MODEL_FILE).read_bytes()[1:])
    else:
        (source / "manifest.json").unlink()
    store = ArtifactStore(tmp_path / "store")
    files = sorted(path.relative_to(source) for path in source.rglob("*"))
    with pytest.raises(CorruptCheckpoint):
        store.ingest_checkpoint(source, job_id=7, step=10)
    assert list((tmp_path / "store" / "jobs" / "7" / "checkpoints").iterdir()) == []  # no final dir, no staging left
    assert sorted(path.relative_to(source) for path in source.rglob("*")) == files  # left where it was, for a look


def test_paths_outside_the_store_are_refused(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(ValueError):
        store.path("../../etc/passwd")


def test_a_tar_download_under_way_survives_retention_deleting_its_checkpoint(tmp_path):
    from service.api.tar_stream import open_files, stream_tar

    store = ArtifactStore(tmp_path / "store")
    relative, _, _ = store.ingest_checkpoint(make_checkpoint(tmp_path / "run" / "step-10"), job_id=7, step=10)
    files = open_files(store.path(relative))  # what the download route does before it answers
    stream = stream_tar(files, "job7-step10")
    first = next(stream)
    store.delete(relative)  # keep_last pruned it meanwhile
    assert not store.path(relative).exists()
    archive = tarfile.open(fileobj=io.BytesIO(first + b"".join(stream)))
    contents = {member.name: archive.extractfile(member).read() for member in archive.getmembers()}
    assert contents["job7-step10/model.safetensors"] == b"weights" * 100
    assert contents["job7-step10/state/optimizer.bin"] == b"optimizer" and "job7-step10/manifest.json" in contents


@pytest.mark.parametrize("byte_range", [None, "bytes=100-299"])
def test_a_weights_download_answered_survives_retention_deleting_its_checkpoint_before_the_body(tmp_path, byte_range):
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from service.api.routes.checkpoints import OpenedFileResponse

    store = ArtifactStore(tmp_path / "store")
    relative, _, _ = store.ingest_checkpoint(make_checkpoint(tmp_path / "run" / "step-10"), job_id=7, step=10)

    def download(request):
        response = OpenedFileResponse(store.path(relative) / MODEL_FILE, filename="w.safetensors")  # what the route answers
        store.delete(relative)  # keep_last pruned it before a byte was sent (it used to be a 500)
        return response

    client = TestClient(Starlette(routes=[Route("/download", download)]))
    response = client.get("/download", headers={"Range": byte_range} if byte_range else {})
    assert not store.path(relative).exists()
    weights = b"weights" * 100
    if byte_range:
        assert response.status_code == 206 and response.content == weights[100:300]
    else:
        assert response.status_code == 200 and response.content == weights


def test_a_checkpoint_without_model_weights_is_stored_and_described_by_its_manifest(tmp_path):
    # What a script's save_state may write: no model.safetensors, just its own files.
    source = tmp_path / "run" / "checkpoint_0"
    source.mkdir(parents=True)
    (source / "optimizer.bin").write_bytes(b"optimizer")
    (source / "custom_checkpoint_0.pkl").write_bytes(b"state!")
    write_manifest(source, 5)
    store = ArtifactStore(tmp_path / "store")
    relative, sha256, size = store.ingest_checkpoint(source, job_id=3, step=5)
    assert sha256 == sha256_file(store.path(relative) / "manifest.json") and size == len(b"optimizer") + len(b"state!")
