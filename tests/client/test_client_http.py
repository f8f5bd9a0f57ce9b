"""Client against the real API app served by uvicorn (SQLite): paging, waiting, errors, and where
its server and token come from. Downloads: test_client_download.py."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api_schemas import JobStatus
from tests.client.conftest import run_next_job
from tests.helpers import tiny_spec
from trainyard.client import Client, TrainyardError, error_message, token_file


@pytest.fixture
def client(api_url, token):
    with Client(api_url, token) as client:
        yield client


def test_jobs_follows_the_cursor_across_pages(client):
    submitted = [client.submit(tiny_spec(name=f"job-{i}")).id for i in range(5)]
    assert [job.id for job in client.jobs(limit=2)] == submitted[::-1]


def test_wait_polls_until_the_job_is_final(client, settings):
    job_id = client.submit(tiny_spec()).id
    seen, seen_running = [], threading.Event()
    with ThreadPoolExecutor(1) as worker:

        def on_update(job) -> None:
            seen.append(job.status)
            if len(seen) == 1:  # the job starts once the client has seen it queued
                worker.submit(run_next_job, settings, seen_running)
            if job.status == JobStatus.running:
                seen_running.set()  # and ends once it has seen it running

        job = client.wait(job_id, poll=0.05, on_update=on_update)
    assert job.status == JobStatus.succeeded
    changes = [status for i, status in enumerate(seen) if i == 0 or status != seen[i - 1]]
    assert [status for status in changes if status != JobStatus.scheduled] == [JobStatus.queued, JobStatus.running, JobStatus.succeeded]


def test_a_rejected_spec_lists_each_problem(client):
    with pytest.raises(TrainyardError) as error:
        client.submit(tiny_spec(**{"model.n_embd": 33, "training.max_steps": -1}))
    assert error.value.status_code == 422
    message = str(error.value)
    assert "model: n_embd (33) must be divisible by n_head (2)" in message
    assert "training.max_steps: Input should be greater than or equal to 1" in message


def test_a_spec_with_nan_is_a_clear_error_not_a_traceback(client):
    with pytest.raises(TrainyardError, match="NaN or an infinite number"):
        client.submit({**tiny_spec(), "priority": float("nan")})


def test_http_errors_carry_the_servers_reason(client, api_url):
    with pytest.raises(TrainyardError, match=r"^job not found \(HTTP 404\)$"):
        client.job(12345)
    job_id = client.submit(tiny_spec()).id
    with Client(api_url, "wrong-token") as stranger:
        with pytest.raises(TrainyardError, match="invalid bearer token; check --token"):  # given as an argument: fix it there
            stranger.job(job_id)


def test_an_unreachable_server_gets_a_hint_not_a_traceback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens: bound, never listening
        with pytest.raises(TrainyardError, match=f"cannot reach Trainyard at {url} — is `trainyard up` running"):
            Client(url, "any-token").job(1)



def test_https_to_a_server_of_plain_http_says_so(api_url):
    # It said "cannot reach Trainyard — is `trainyard up` running?", while it ran.
    with pytest.raises(TrainyardError, match=r"does not answer in HTTPS .*: is its address http://\?"):
        Client(api_url.replace("http://", "https://"), "any-token").job(1)


def test_a_client_that_found_no_server_says_it_tried_the_default(monkeypatch, tmp_path):
    # Found by a new user: run outside `trainyard up`'s folder, the CLI tried port 8000 while the
    # stack was on 8765, and said only that nothing answered.
    monkeypatch.delenv("TRAINYARD_DATA_DIR")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainyardError, match=r"at http://127.0.0.1:8000 \(the default: no `.trainyard/` here or above.*or pass --server\)"):
        Client(token="any-token").job(1)


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
    assert Client("http://a:1/v1/", "from-arg").server == "http://a:1"  # the API's prefix given too: taken as meant
    monkeypatch.setenv("TRAINYARD_TOKEN", " from-env\u00a0\n")  # as pasted: spaces and a line end left out
    assert Client().token == "from-env"


def test_the_token_of_trainyard_up_is_found_from_a_folder_below_the_one_it_ran_in(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINYARD_DATA_DIR")
    (tmp_path / ".trainyard").mkdir()
    (tmp_path / ".trainyard" / "token").write_text("ty_up\n")
    (tmp_path / "experiments" / "lr").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "experiments" / "lr")
    assert Client().token == "ty_up" and token_file() == tmp_path / ".trainyard" / "token"
    assert Client().server == "http://127.0.0.1:8000"
    (tmp_path / ".trainyard" / "server").write_text("http://127.0.0.1:8765\n")  # `trainyard up --port 8765`
    assert Client().server == "http://127.0.0.1:8765"
    (tmp_path / "experiments" / ".trainyard").mkdir()  # a data dir without a token (never `up`) is passed by
    assert (Client().token, Client().server) == ("ty_up", "http://127.0.0.1:8765")


@pytest.mark.parametrize(
    "text, reason",
    [("server: [unclosed", "cannot read the config file"), ("- a list", "expected only `server:` and `token:`"),
     ("sever: https://typo.example", "expected only `server:` and `token:`"),
     (b"\xff\xfe", "cannot read the config file"), ("token: ty_\u2026", "holds '…', which no token has")],  # were tracebacks
)
def test_a_config_file_that_cannot_be_used_says_why(monkeypatch, tmp_path, text, reason):
    (tmp_path / "config.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
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
                {"loc": ["body", "dataset"], "msg": "Value error, dataset: give exactly one of `path` and `upload_id`", "type": "value_error"},
            ]}),
            "the server rejected the request (HTTP 422):\n"
            "  model: n_embd (33) must be divisible by n_head (4)\n"
            "  optimizer.betas[0]: Input should be less than 1\n"
            "  fp16 needs device 'cuda'\n"
            "  dataset: give exactly one of `path` and `upload_id`",  # named once, though its check names it too
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
