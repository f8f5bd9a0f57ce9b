"""Client against a real HTTP server (the fake API in a thread): downloads, paging, waiting, errors."""

from __future__ import annotations

import socket

import httpx
import pytest

from api_schemas import JobStatus
from tests.client.fake_server import (
    CORRUPT_CHECKPOINT,
    FOLLOWED_JOB,
    GOOD_CHECKPOINT,
    INTERRUPTED_AFTER,
    INTERRUPTED_CHECKPOINT,
    TOKEN,
)
from tests.helpers import tiny_spec
from trainyard.client import Client, TrainyardError, error_message


@pytest.fixture
def client(fake_api):
    url, _ = fake_api
    with Client(url, TOKEN) as client:
        yield client


def test_download_verifies_and_renames_the_file(client, fake_api, tmp_path, model_bytes):
    seen = []
    dest = client.download(GOOD_CHECKPOINT, tmp_path / "out" / "model.safetensors", progress=lambda done, total: seen.append((done, total)))
    assert dest.read_bytes() == model_bytes
    assert not dest.with_name("model.safetensors.part").exists()
    assert seen[-1] == (len(model_bytes), len(model_bytes))
    assert fake_api[1].range_headers == [None]


def test_download_resumes_a_truncated_part_file(client, fake_api, tmp_path, model_bytes):
    dest = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.part").write_bytes(model_bytes[:100_000])
    seen = []
    client.download(GOOD_CHECKPOINT, dest, progress=lambda done, total: seen.append((done, total)))
    assert dest.read_bytes() == model_bytes
    assert fake_api[1].range_headers == ["bytes=100000-"]  # only the rest was fetched
    assert seen[-1] == (len(model_bytes), len(model_bytes))


def test_an_interrupted_download_keeps_its_part_file_and_resumes(client, fake_api, tmp_path, model_bytes):
    dest = tmp_path / "model.safetensors"
    with pytest.raises(TrainyardError, match="model.safetensors.part is kept: run the download again to resume"):
        client.download(INTERRUPTED_CHECKPOINT, dest)
    assert (tmp_path / "model.safetensors.part").read_bytes() == model_bytes[:INTERRUPTED_AFTER]
    client.download(INTERRUPTED_CHECKPOINT, dest)
    assert dest.read_bytes() == model_bytes
    assert fake_api[1].range_headers == [None, f"bytes={INTERRUPTED_AFTER}-"]


def test_a_part_file_longer_than_the_checkpoint_is_downloaded_again(client, fake_api, tmp_path, model_bytes):
    dest = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.part").write_bytes(b"x" * (len(model_bytes) + 10))
    client.download(GOOD_CHECKPOINT, dest)
    assert dest.read_bytes() == model_bytes
    assert fake_api[1].range_headers == [f"bytes={len(model_bytes) + 10}-", None]  # 416, then from the start


def test_sha256_mismatch_is_an_error_and_leaves_no_file(client, tmp_path):
    dest = tmp_path / "model.safetensors"
    with pytest.raises(TrainyardError, match="sha256 mismatch.*corrupt"):
        client.download(CORRUPT_CHECKPOINT, dest)
    assert not dest.exists() and not (tmp_path / "model.safetensors.part").exists()


def test_a_corrupt_resumed_prefix_fails_verification(client, tmp_path, model_bytes):
    (tmp_path / "model.safetensors.part").write_bytes(b"\0" * 1000)
    with pytest.raises(TrainyardError, match="sha256 mismatch"):
        client.download(GOOD_CHECKPOINT, tmp_path / "model.safetensors")


def test_jobs_follows_the_cursor_across_pages(client):
    assert [job.id for job in client.jobs(limit=2)] == [5, 4, 3, 2, 1]


def test_wait_polls_until_the_job_is_final(client, monkeypatch):
    monkeypatch.setattr("trainyard.client.time.sleep", lambda seconds: None)
    seen = []
    job = client.wait(FOLLOWED_JOB, on_update=lambda job: seen.append(job.status))
    assert job.status == JobStatus.succeeded
    assert seen == [JobStatus.queued, JobStatus.running, JobStatus.succeeded]


def test_a_rejected_spec_lists_each_problem(client):
    with pytest.raises(TrainyardError) as error:
        client.submit(tiny_spec(**{"model.n_embd": 33, "training.max_steps": -1}))
    assert error.value.status_code == 422
    message = str(error.value)
    assert "model: n_embd (33) must be divisible by n_head (2)" in message
    assert "training.max_steps: Input should be greater than or equal to 1" in message


def test_http_errors_carry_the_servers_reason(client, fake_api):
    with pytest.raises(TrainyardError, match=r"^job not found \(HTTP 404\)$"):
        client.job(12345)
    with Client(fake_api[0], "wrong-token") as stranger:
        with pytest.raises(TrainyardError, match="invalid bearer token; pass --token or set TRAINYARD_TOKEN"):
            stranger.job(FOLLOWED_JOB)


def test_an_unreachable_server_gets_a_hint_not_a_traceback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens: bound, never listening
        with pytest.raises(TrainyardError, match=f"cannot reach Trainyard at {url} — is `trainyard up` running"):
            Client(url, TOKEN).job(1)


def test_server_and_token_come_from_args_then_env_then_config_file_then_token_file(monkeypatch, tmp_path):
    assert Client().server == "http://127.0.0.1:8000" and Client().token is None
    monkeypatch.setenv("TRAINYARD_DATA_DIR", str(tmp_path))
    (tmp_path / "token").write_text("from-file\n")
    assert Client().token == "from-file"
    config = tmp_path / "config.yaml"
    monkeypatch.setenv("TRAINYARD_CONFIG", str(config))
    config.write_text("server: https://yard.example\ntoken: from-config\n")
    assert (Client().server, Client().token) == ("https://yard.example", "from-config")
    monkeypatch.setenv("TRAINYARD_TOKEN", "from-env")
    monkeypatch.setenv("TRAINYARD_SERVER", "http://trainyard.example:9000/")
    assert (Client().server, Client().token) == ("http://trainyard.example:9000", "from-env")
    assert (Client("http://a:1", "from-arg").server, Client("http://a:1", "from-arg").token) == ("http://a:1", "from-arg")


@pytest.mark.parametrize(
    "text, reason",
    [("server: [unclosed", "cannot read the config file"), ("- a list", "expected only `server:` and `token:`"),
     ("sever: https://typo.example", "expected only `server:` and `token:`")],
)
def test_a_config_file_that_cannot_be_used_says_why(monkeypatch, tmp_path, text, reason):
    (tmp_path / "config.yaml").write_text(text)
    monkeypatch.setenv("TRAINYARD_CONFIG", str(tmp_path / "config.yaml"))
    with pytest.raises(TrainyardError, match=reason):
        Client()


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (
            httpx.Response(422, json={"detail": [
                {"loc": ["body", "model"], "msg": "Value error, n_embd (33) must be divisible by n_head (4)", "type": "value_error"},
                {"loc": ["body", "optimizer", "betas", 0], "msg": "Input should be less than 1", "type": "less_than"},
                {"loc": ["body"], "msg": "Value error, fp16 needs device 'cuda'", "type": "value_error"},
            ]}),
            "the server rejected the request (HTTP 422):\n"
            "  model: n_embd (33) must be divisible by n_head (4)\n"
            "  optimizer.betas[0]: Input should be less than 1\n"
            "  fp16 needs device 'cuda'",
        ),
        (httpx.Response(422, json={"detail": "dataset file is empty"}), "dataset file is empty (HTTP 422)"),
        (
            httpx.Response(429, json={"detail": {"msg": "3 active jobs (queued, scheduled or running); the limit is 3 per user", "limit": 3, "active": 3}}),
            "3 active jobs (queued, scheduled or running); the limit is 3 per user (HTTP 429)",
        ),
        (httpx.Response(502, text="<html>Bad Gateway</html>"), "<html>Bad Gateway</html> (HTTP 502)"),
        (httpx.Response(500, text=""), "Internal Server Error (HTTP 500)"),
    ],
)
def test_error_messages(response, expected):
    assert error_message(response) == expected
