"""Uploaded datasets and code bundles: streamed to disk with a size limit and sha256, owned by
their user, code bundles unpacked with nothing landing outside their directory."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from service.db.accounts import create_user
from service.db.session import session_factory
from service.uploads import UploadRefused, unpack_bundle
from tests.helpers import auth, tiny_spec

CORPUS = ("to be or not to be, that is the question\n" * 200).encode()


@pytest.fixture
def settings_overrides() -> dict:
    return {"max_request_bytes": 50_000, "max_upload_bytes": 100_000, "max_unpacked_bytes": 20_000, "max_unpacked_files": 20}


@pytest.fixture
def tokens(settings) -> dict[str, str]:
    with session_factory(settings.resolved_database_url)() as session:
        return {name: create_user(session, name, is_admin=name == "root")[1] for name in ("alice", "bob", "root")}


OCTETS = {"Content-Type": "application/octet-stream"}


def upload(api, token: str, route: str, body: bytes, name: str = "corpus.txt"):
    return api.post(route, params={"name": name}, content=body, headers={**auth(token), **OCTETS})


def test_an_uploaded_dataset_is_stored_with_its_sha256_and_a_job_trains_on_it_by_id(api, tokens, settings):
    response = upload(api, tokens["alice"], "/v1/datasets", CORPUS)
    assert response.status_code == 201, response.text
    dataset = response.json()
    assert dataset["sha256"] == hashlib.sha256(CORPUS).hexdigest() and dataset["size_bytes"] == len(CORPUS)
    assert dataset["name"] == "corpus.txt" and dataset["kind"] == "dataset"
    assert (settings.resolved_data_root / "uploads" / str(dataset["id"])).read_bytes() == CORPUS
    assert not list((settings.resolved_data_root / "uploads").glob(".tmp-*"))

    assert api.get("/v1/datasets", headers=auth(tokens["alice"])).json() == [dataset]
    assert api.get(f"/v1/datasets/{dataset['id']}", headers=auth(tokens["alice"])).json() == dataset

    spec = tiny_spec(**{"dataset.upload_id": dataset["id"]})
    del spec["dataset"]["path"]
    job = api.post("/v1/jobs", json=spec, headers=auth(tokens["alice"]))
    assert job.status_code == 201, job.text
    assert job.json()["spec"]["dataset"]["upload_id"] == dataset["id"]


def test_another_users_upload_is_404_and_unusable_in_a_job(api, tokens):
    dataset = upload(api, tokens["alice"], "/v1/datasets", CORPUS).json()
    bundle = upload(api, tokens["alice"], "/v1/code", tar_of({"train.py": b"print('hi')\n"}), "code.tar").json()
    for path in (f"/v1/datasets/{dataset['id']}", f"/v1/code/{bundle['id']}"):
        assert api.get(path, headers=auth(tokens["bob"])).status_code == 404
        assert api.get(path, headers=auth(tokens["root"])).status_code == 200  # admins see all
    assert api.get("/v1/datasets", headers=auth(tokens["bob"])).json() == []
    assert api.get("/v1/code", headers=auth(tokens["bob"])).json() == []
    # A dataset id is not a code id: each kind is looked up on its own route.
    assert api.get(f"/v1/code/{dataset['id']}", headers=auth(tokens["alice"])).status_code == 404

    spec = tiny_spec(**{"dataset.upload_id": dataset["id"]})
    del spec["dataset"]["path"]
    response = api.post("/v1/jobs", json=spec, headers=auth(tokens["bob"]))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "dataset", "upload_id"]
    # Nor can a path reach the uploads directory, where ids are easy to guess.
    response = api.post("/v1/jobs", json=tiny_spec(**{"dataset.path": f"uploads/{dataset['id']}"}), headers=auth(tokens["bob"]))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "dataset", "path"] and "upload_id" in response.json()["detail"][0]["msg"]


def test_a_dataset_needs_exactly_one_of_path_and_upload_id(api, tokens):
    response = api.post("/v1/jobs", json=tiny_spec(**{"dataset.upload_id": 1}), headers=auth(tokens["alice"]))
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "dataset"] and "exactly one of `path` and `upload_id`" in error["msg"]


def test_empty_and_oversized_uploads_are_refused_and_leave_nothing_behind(api, tokens, settings):
    empty = upload(api, tokens["alice"], "/v1/datasets", b"")
    assert empty.status_code == 422 and "empty" in empty.json()["detail"][0]["msg"]
    big = upload(api, tokens["alice"], "/v1/datasets", b"x" * 100_001)
    assert big.status_code == 413 and "100000 bytes" in big.json()["detail"]

    # Without a Content-Length (chunked), the limit applies as the bytes arrive.
    def chunks():
        for _ in range(20):
            yield b"x" * 10_000

    streamed = api.post("/v1/datasets", params={"name": "big.txt"}, content=chunks(), headers={**auth(tokens["alice"]), **OCTETS})
    assert streamed.status_code == 413
    # A body over max_request_bytes but within max_upload_bytes is fine on an upload route.
    assert upload(api, tokens["alice"], "/v1/datasets", b"y" * 60_000).status_code == 201
    assert api.get("/v1/datasets", headers=auth(tokens["alice"])).json()[0]["size_bytes"] == 60_000
    assert not list((settings.resolved_data_root / "uploads").glob(".tmp-*"))


def test_a_name_with_a_slash_or_no_name_is_refused(api, tokens):
    response = upload(api, tokens["alice"], "/v1/datasets", CORPUS, name="../x.txt")
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "name"]
    response = api.post("/v1/datasets", content=CORPUS, headers={**auth(tokens["alice"]), **OCTETS})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "name"]


def test_a_multipart_form_upload_is_streamed_the_same_way_and_named_by_its_file(api, tokens, settings):
    response = api.post("/v1/datasets", files={"note": (None, "ignored"), "file": ("my corpus.txt", CORPUS)}, headers=auth(tokens["alice"]))
    assert response.status_code == 201, response.text
    dataset = response.json()
    assert dataset["name"] == "my corpus.txt" and dataset["sha256"] == hashlib.sha256(CORPUS).hexdigest()
    assert (settings.resolved_data_root / "uploads" / str(dataset["id"])).read_bytes() == CORPUS

    named = api.post("/v1/code", params={"name": "bundle.tar"}, files={"file": ("x", tar_of({"a.py": b"1"}))}, headers=auth(tokens["alice"]))
    assert named.status_code == 201 and named.json()["name"] == "bundle.tar"

    no_file = api.post("/v1/datasets", files={"other": ("a.txt", CORPUS)}, headers=auth(tokens["alice"]))
    assert no_file.status_code == 422 and "no `file` field" in no_file.json()["detail"][0]["msg"]
    too_big = api.post("/v1/datasets", files={"file": ("big.txt", b"x" * 100_001)}, headers=auth(tokens["alice"]))
    assert too_big.status_code == 413
    assert [d["id"] for d in api.get("/v1/datasets", headers=auth(tokens["alice"])).json()] == [dataset["id"]]
    assert not list((settings.resolved_data_root / "uploads").glob(".tmp-*"))


# --- code bundles --------------------------------------------------------------------------------

def tar_of(files: dict[str, bytes], links: dict[str, str] | None = None, hard: bool = False, gz: bool = False) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz" if gz else "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if name.endswith(".sh") else 0o644
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = (tarfile.LNKTYPE if hard else tarfile.SYMTYPE), target
            tar.addfile(info)
    return out.getvalue()


def zip_of(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, data in files.items():
            bundle.writestr(name, data)
    return out.getvalue()


def test_a_code_bundle_unpacks_into_its_own_directory(api, tokens, settings):
    files = {"train.py": b"print('train')\n", "lib/util.py": b"X = 1\n", "run.sh": b"#!/bin/sh\n"}
    for body, name in ((tar_of(files, gz=True), "code.tgz"), (zip_of(files), "code.zip")):
        response = upload(api, tokens["alice"], "/v1/code", body, name)
        assert response.status_code == 201, response.text
        bundle = response.json()
        assert bundle["sha256"] == hashlib.sha256(body).hexdigest() and bundle["kind"] == "code"
        directory = settings.resolved_artifact_root / "code" / str(bundle["id"])
        assert {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()} == set(files)
        assert (directory / "lib" / "util.py").read_bytes() == b"X = 1\n"
    assert not list((settings.resolved_artifact_root / "code").glob(".tmp-*"))


MALICIOUS = {
    "parent": (tar_of({"../escaped.py": b"x"}), "'..' is not allowed"),
    "absolute": (tar_of({"/etc/escaped.py": b"x"}), "absolute paths are not allowed"),
    "symlink out": (tar_of({"a.py": b"x"}, links={"passwd": "/etc/passwd"}), "links are not allowed"),
    "hardlink out": (tar_of({"a.py": b"x"}, links={"passwd": "/etc/passwd"}, hard=True), "links are not allowed"),
    "zip parent": (zip_of({"../../escaped.py": b"x"}), "'..' is not allowed"),
    "too big unpacked": (tar_of({"big.bin": b"\0" * 30_000}, gz=True), "unpacks to more than 20000 bytes"),
    "zip bomb": (zip_of({"bomb.bin": b"\0" * 90_000}), "unpacks to more than 20000 bytes"),
    "too many files": (tar_of({f"f{i}.py": b"" for i in range(21)}), "more than 20 files"),
    "not an archive": (b"just some text, not an archive", "must be a tar"),
    "cut short": (tar_of({"train.py": bytes(range(256)) * 64}, gz=True)[:300], "the tar archive is unreadable"),  # was a 500
}


@pytest.mark.parametrize("case", MALICIOUS, ids=list(MALICIOUS))
def test_a_malicious_or_oversized_bundle_is_refused_and_nothing_is_written(api, tokens, settings, tmp_path, case):
    body, reason = MALICIOUS[case]
    response = upload(api, tokens["alice"], "/v1/code", body, "code.tar")
    assert response.status_code == 422, response.text
    assert reason in response.json()["detail"][0]["msg"]
    assert api.get("/v1/code", headers=auth(tokens["alice"])).json() == []
    code_dir = settings.resolved_artifact_root / "code"
    assert not [p for p in code_dir.rglob("*")], list(code_dir.rglob("*"))
    assert not (tmp_path / "escaped.py").exists() and not (settings.resolved_artifact_root / "escaped.py").exists()


def test_unpacking_refuses_a_device_node(tmp_path: Path):
    archive = tmp_path / "dev.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("null")
        info.type = tarfile.CHRTYPE
        tar.addfile(info)
    with pytest.raises(UploadRefused, match="only files and directories"):
        unpack_bundle(archive, tmp_path / "out", 1000, 10)
    assert not any((tmp_path / "out").iterdir())
