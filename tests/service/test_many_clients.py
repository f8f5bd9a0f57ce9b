"""Many users at once, against the real API served by uvicorn on 127.0.0.1 (SQLite and PostgreSQL):
slow clients hold no transaction, hundreds of followers share one watcher, cut-short bodies store
nothing. Bounded: each test ends in well under a minute."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from sqlalchemy import select

from api_schemas import AttemptStatus
from service.db.accounts import create_user, revoke
from service.db.attempts import renew_lease
from service.db.checkpoints import list_checkpoints, record_checkpoint
from service.db.hosts import record_heartbeat
from service.db.log_lines import record_logs
from service.db.metrics import record_metrics
from service.db.models import Upload, User
from service.db.session import read_session_factory, session_factory
from stack.cli import KEEP_ALIVE_SECONDS
from tests.helpers import auth, finish_job, start_job, tiny_spec

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def settings_overrides() -> dict:
    return {"events_poll_seconds": 0.2, "events_heartbeat_seconds": 1.0, "max_streams_per_user": 1000}


@pytest.fixture
def tokens(settings) -> dict[str, str]:
    with session_factory(settings.resolved_database_url)() as session:
        return {name: create_user(session, name)[1] for name in ("alice", "bob")}


@pytest.fixture
def server(settings, tmp_path):
    """The API in a uvicorn process of its own, as deployed: its event loop and threads shared with nothing of the test's."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, **{f"TRAINYARD_{name.upper()}": str(value) for name, value in settings.model_dump(exclude_none=True).items() if name in SERVED}}
    with open(tmp_path / "api.log", "w") as log:
        api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "service.api.main:create_app", "--port", str(port), "--log-level", "warning",
             "--timeout-keep-alive", str(KEEP_ALIVE_SECONDS)],
            env=environment, stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/healthz")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and api.poll() is None, "the API did not start"
                time.sleep(0.1)
        yield url
    finally:
        api.terminate()
        api.wait(10)
    assert "Traceback" not in (tmp_path / "api.log").read_text()  # no 5xx, no failure behind one


SERVED = ("data_dir", "database_url", "data_root", "events_poll_seconds", "events_heartbeat_seconds", "max_streams_per_user")


def raw_request(url: str, head: str, timeout: float = 30) -> socket.socket:
    """A connection to the server with `head` (request line and headers) sent; the body is the caller's."""
    host, port = url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=timeout)
    connection.sendall(head.encode() + b"\r\n")
    return connection


def response_status(connection: socket.socket) -> int:
    return int(connection.recv(4096).split(b" ", 2)[1])


def test_a_slow_upload_and_a_slow_download_delay_no_other_request_nor_the_worker(server, settings, tokens):
    sessions = session_factory(settings.resolved_database_url)
    alice, bob = auth(tokens["alice"]), auth(tokens["bob"])
    job_id = httpx.post(f"{server}/v1/jobs", json=tiny_spec(), headers=alice).json()["id"]
    claimed = start_job(settings, job_id)
    checkpoint = settings.resolved_artifact_root / "ck" / "12"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"w" * (8 << 20))  # far more than the socket buffers hold
    with sessions() as session:
        record_checkpoint(session, job_id, claimed.attempt_id, 12, "ck/12", "0" * 64, 8 << 20, keep_last=2)
        [checkpoint_id] = [c.id for c in list_checkpoints(session, job_id)]

    body = b"slowly sent\n"
    uploading = raw_request(
        server, f"POST /v1/datasets?name=slow.txt HTTP/1.1\r\nHost: x\r\nAuthorization: {alice['Authorization']}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n",
    )
    downloading = raw_request(server, f"GET /v1/checkpoints/{checkpoint_id}/download HTTP/1.1\r\nHost: x\r\nAuthorization: {alice['Authorization']}\r\n")
    downloading.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

    def read_slowly() -> None:  # 8 KB/s
        try:
            while downloading.recv(1024):
                time.sleep(1 / 8)
        except OSError:
            pass

    threading.Thread(target=read_slowly, daemon=True).start()
    slowest, statuses = 0.0, []
    for byte in body[:-1]:  # 1 byte/s, for 11 s
        uploading.sendall(bytes([byte]))
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            started = time.monotonic()
            statuses.append(httpx.get(f"{server}/v1/jobs", headers=bob, timeout=10).status_code)
            with sessions() as session:  # the worker's lease renewal and heartbeat
                assert renew_lease(session, claimed, settings.lease_seconds).held
                record_heartbeat(session, "host-a")
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.2)
    # A request held behind either slow client would wait its whole 11 s (the upload) or ~1,000 s
    # (the download); 1.9 s was seen on a busy 2-core machine, so the bound tells a stall from load.
    assert slowest < 5.0 and set(statuses) == {200}, (slowest, statuses)

    uploading.sendall(body[-1:])
    assert response_status(uploading) == 201
    finish_job(settings, claimed)
    job = httpx.get(f"{server}/v1/jobs/{job_id}", headers=alice).json()
    assert job["status"] == "succeeded" and [a["status"] for a in job["attempts"]] == [AttemptStatus.succeeded.value]
    downloading.close()
    uploading.close()


async def follow(client: httpx.AsyncClient, url: str, headers: dict, caught_up: list[int], ended_at: list[float]) -> list[str]:
    """The SSE event names of one followed stream, to its end; notes when it had its first item and when the end came."""
    names = []
    async with client.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
                if len(names) == 1:
                    caught_up.append(1)
                if names[-1] == "end":
                    ended_at.append(time.monotonic())
    return names


def test_hundreds_of_followers_all_see_the_end_and_the_api_keeps_answering(server, settings, tokens, database_url):
    followers = 200 if database_url.startswith("sqlite") else 500
    alice = auth(tokens["alice"])
    job_id = httpx.post(f"{server}/v1/jobs", json=tiny_spec(), headers=alice).json()["id"]
    claimed = start_job(settings, job_id)
    with session_factory(settings.resolved_database_url)() as session:
        record_logs(session, job_id, claimed, [(i, 0, f"line {i}") for i in range(50)])

    async def run() -> tuple[list, list[float], float, float]:
        # Clients of 50 streams each, and one of its own for the probes: one httpx client's pool
        # spends time quadratic in its connections on each that closes (500 ends took the test's
        # own event loop 5 s), which would be timed as the server's.
        async with contextlib.AsyncExitStack() as clients:
            pools = [await clients.enter_async_context(httpx.AsyncClient(limits=httpx.Limits(max_connections=50), timeout=60))
                     for _ in range(followers // 50)]
            client = await clients.enter_async_context(httpx.AsyncClient(timeout=60))
            ended_at: list[float] = []
            caught_up: list[int] = []
            urls = [f"{server}/v1/jobs/{job_id}/events", f"{server}/v1/jobs/{job_id}/logs?follow=true&tail=10"]
            streams = [asyncio.create_task(follow(pools[i % len(pools)], urls[i % 2], alice, caught_up, ended_at)) for i in range(followers)]
            health: list[float] = []
            async def probe() -> None:
                started = time.monotonic()
                response = await client.get(f"{server}/healthz")
                assert response.status_code == 200
                health.append(time.monotonic() - started)
                listed = await client.get(f"{server}/v1/jobs", headers=alice)
                assert listed.status_code == 200

            while len(caught_up) < followers:  # while they connect and catch up
                await probe()
                await asyncio.sleep(0.2)
            for _ in range(5):  # all of them waiting
                await probe()
                await asyncio.sleep(0.2)
            await asyncio.to_thread(finish_job, settings, claimed)
            finished = time.monotonic()
            await probe()
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)
            return results, ended_at, finished, max(health)

    results, ended_at, finished, slowest_health = asyncio.run(run())
    assert all(names[-1] == "end" for names in results)
    late = sorted(round(t - finished, 2) for t in ended_at)
    assert len(ended_at) == followers and late[-1] < 5, late[-20:]
    # A stalled API (the issue's: followers holding the pool) times out at 30 s; on two shared
    # cores with hundreds of streams reconnecting, several seconds is slow, not stalled (a CI run
    # beside a training benchmark saw 6.6 s): the bound tells the two apart, it measures no speed.
    assert slowest_health < 15.0, slowest_health


@pytest.mark.parametrize("settings_overrides", [{"events_poll_seconds": 60.0, "events_heartbeat_seconds": 1.0}])
def test_a_follower_hears_of_new_items_when_they_commit_not_at_the_next_poll(server, settings, tokens, database_url):
    if database_url.startswith("sqlite"):
        pytest.skip("SQLite has no NOTIFY: its watchers read every events_poll_seconds")
    alice = auth(tokens["alice"])
    job_id = httpx.post(f"{server}/v1/jobs", json=tiny_spec(), headers=alice).json()["id"]
    claimed = start_job(settings, job_id)
    sessions = session_factory(settings.resolved_database_url)

    async def first_new(url: str, write) -> float:
        """Seconds from `write` (committed once the stream is open and idle) to the stream's next item."""
        async with httpx.AsyncClient(timeout=30) as client, client.stream("GET", url, headers=alice) as response:
            lines = response.aiter_lines()
            while await anext(lines) != ": keep-alive":  # caught up and waiting
                pass
            await asyncio.to_thread(write)
            written = time.monotonic()
            while not (await anext(lines)).startswith("id: "):
                pass
            return time.monotonic() - written

    def metrics() -> None:
        with sessions() as session:
            record_metrics(session, job_id, claimed.attempt_id, [(1, "train_loss", 2.5)])

    def logs() -> None:
        with sessions() as session:
            record_logs(session, job_id, claimed, [(1, 0, "a new line")])

    # A 60 s poll, and a fallback read every 5 s: well under either, the NOTIFY woke the watcher.
    assert asyncio.run(first_new(f"{server}/v1/jobs/{job_id}/events", metrics)) < 2.5
    assert asyncio.run(first_new(f"{server}/v1/jobs/{job_id}/logs?follow=true", logs)) < 2.5


def test_a_multipart_body_without_its_closing_boundary_is_422_and_nothing_is_stored(server, settings, tokens):
    alice = auth(tokens["alice"])
    head = b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="cut.txt"\r\nContent-Type: text/plain\r\n\r\n'
    whole = head + b"all of it\n\r\n--XyZ--\r\n"
    multipart = {**alice, "Content-Type": "multipart/form-data; boundary=XyZ"}
    response = httpx.post(f"{server}/v1/datasets", content=head + b"the start of", headers=multipart)
    assert response.status_code == 422 and "closing boundary" in response.text
    assert httpx.post(f"{server}/v1/datasets", content=whole, headers=multipart).status_code == 201

    # A body that stops short of its Content-Length: the client is gone, nothing is stored.
    cut = raw_request(
        server, f"POST /v1/datasets?name=short.txt HTTP/1.1\r\nHost: x\r\nAuthorization: {alice['Authorization']}\r\n"
        "Content-Type: application/octet-stream\r\nContent-Length: 1000\r\n",
    )
    cut.sendall(b"only 24 bytes of a 1000\n")
    cut.shutdown(socket.SHUT_WR)
    cut.close()
    time.sleep(0.5)
    with read_session_factory(settings.resolved_database_url)() as session:
        assert [u.name for u in session.scalars(select(Upload))] == ["cut.txt"]  # the whole one only
    assert sorted(p.name for p in (settings.resolved_data_root / "uploads").iterdir()) == ["1"]


def test_a_burst_of_submits_past_the_connection_pool_is_all_admitted(server, tokens):
    """Each submit reads (its checks) then writes (the insert); were the read's connection held
    across the insert, 15 submits at once would take the pool and wait for each other until its
    timeout, then answer 500. Past the thread pool's 40 threads, a route whose session outlived
    it (FastAPI ends it after validating the response, for which it waits for a thread) held a
    connection, and on SQLite the write lock, while every thread waited for a connection: nothing
    moved for the pool's 30 s, then 500s (the worker's lease renewal stalled with it)."""
    alice = auth(tokens["alice"])
    burst = 80  # past the pool's 15 connections, and twice the thread pool's 40 threads

    async def submit_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server, headers=alice, limits=httpx.Limits(max_connections=burst), timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/jobs", json=tiny_spec()) for _ in range(burst)))

    started = time.monotonic()
    answers = asyncio.run(submit_all())
    assert [answer.status_code for answer in answers] == [201] * burst and time.monotonic() - started < 20
    listed = httpx.get(f"{server}/v1/jobs", params={"limit": 200}, headers=alice).json()["items"]
    assert {job["id"] for job in listed} == {answer.json()["id"] for answer in answers}


def test_thirty_submits_with_one_idempotency_key_make_one_job_and_answer_every_one_with_it(server, tokens):
    """A client retrying a submit over a flaky network may send the same key many times at once.
    The unique (owner, key) decides which insert wins; the others wait for it and answer with its
    job, none with a 5xx, and another user's listing meanwhile answers at once."""
    alice, bob = auth(tokens["alice"]), auth(tokens["bob"])
    burst = 30

    async def submit_all() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server, limits=httpx.Limits(max_connections=burst + 1), timeout=60) as client:
            same = [client.post("/v1/jobs", json=tiny_spec(), headers={**alice, "Idempotency-Key": "retry-1"}) for _ in range(burst)]
            *answers, listing = await asyncio.gather(*same, client.get("/v1/jobs", headers=bob))
            return answers, listing

    answers, listing = asyncio.run(submit_all())
    assert sorted({answer.status_code for answer in answers}) in ([201], [200, 201]), [a.text for a in answers if a.status_code >= 300]
    assert len({answer.json()["id"] for answer in answers}) == 1
    assert listing.status_code == 200
    assert len(httpx.get(f"{server}/v1/jobs", headers=alice).json()["items"]) == 1


@pytest.mark.parametrize("how", ["rotated", "revoked"])
def test_open_streams_end_within_seconds_once_their_token_is_rotated_or_revoked(server, settings, tokens, how):
    """A stream is authenticated when it starts, and may stay open for days: a leaked token that is
    rotated or revoked must stop delivering, not keep a follower reading the job's events and logs."""
    alice = auth(tokens["alice"])
    job_id = httpx.post(f"{server}/v1/jobs", json=tiny_spec(), headers=alice).json()["id"]
    claimed = start_job(settings, job_id)
    with session_factory(settings.resolved_database_url)() as session:
        record_logs(session, job_id, claimed, [(i, 0, f"line {i}") for i in range(5)])

    async def run() -> tuple[list[list[str]], float]:
        async with httpx.AsyncClient(timeout=60) as client:
            caught_up: list[int] = []
            urls = [f"{server}/v1/jobs/{job_id}/events", f"{server}/v1/jobs/{job_id}/logs?follow=true"]
            streams = [asyncio.create_task(follow(client, url, alice, caught_up, [])) for url in urls]
            while len(caught_up) < len(urls):
                await asyncio.sleep(0.1)
            if how == "rotated":
                assert (await client.post(f"{server}/v1/token/rotate", headers=alice)).status_code == 200
            else:
                await asyncio.to_thread(revoke_user, settings, "alice")
            cut_at = time.monotonic()
            names = await asyncio.wait_for(asyncio.gather(*streams), 30)
            return names, time.monotonic() - cut_at

    names, took = asyncio.run(run())
    assert took < 10, took
    assert all("end" not in stream for stream in names), names  # cut, not ended: the job runs on
    again = httpx.get(f"{server}/v1/jobs/{job_id}/events", headers=alice)
    assert again.status_code == 401 and ("revoked" in again.text) == (how == "revoked"), again.text


def revoke_user(settings, name: str) -> None:
    with session_factory(settings.resolved_database_url)() as session:
        revoke(session, session.scalar(select(User).where(User.name == name)))
