"""Two API processes on PostgreSQL + Redis, behind the shipped nginx config: every route is served
through either (and by the other when one stops), a user's stream cap holds across both (counted in
Redis), and a follower that reconnects to the other process with Last-Event-ID misses no event."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from contextlib import ExitStack

import httpx
import pytest

from stack.embedded import embedded_stack, stop_children, wait_healthy
from tests.e2e.test_end_to_end import wait_for
from tests.helpers import tiny_spec
from tests.nginx import nginx_in_front
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(300)
STREAMS = 2


@pytest.fixture
def two_apis(tmp_path, monkeypatch, postgres_url, redis_url):
    """(the stack's API URL, a second API process's URL, nginx in front of both, the admin token, the second's process)."""
    monkeypatch.setenv("TRAINYARD_MAX_STREAMS_PER_USER", str(STREAMS))
    with embedded_stack(tmp_path / "yard", free_port(), workers=1, database_url=postgres_url, broker_url=redis_url) as info:
        port = free_port()
        env = {**os.environ, "TRAINYARD_DATA_DIR": str(info.data_dir), "TRAINYARD_DATABASE_URL": postgres_url, "TRAINYARD_BROKER_URL": redis_url}
        with open(tmp_path / "second-api.log", "ab") as log:
            second = subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            other = f"http://127.0.0.1:{port}"
            wait_healthy(other, [second])
            api_ports = [int(info.url.rpartition(":")[2]), port]
            with nginx_in_front(api_ports, info.data_dir / "artifacts", tmp_path / "nginx", free_port()) as proxy:
                yield info.url, other, proxy, info.token, second
        finally:
            stop_children([second])


def client(url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def test_a_users_stream_cap_holds_across_both_api_processes_and_one_stopped_ends_its_streams_to_resume_on_the_other(two_apis):
    first, second, _, token, second_process = two_apis
    with client(first, token) as a, client(second, token) as b:
        job_id = a.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 10**6})).json()["id"]
        with ExitStack() as open_streams:
            # One stream open on each process: the user's two.
            for api in (a, b):
                stream = open_streams.enter_context(api.stream("GET", f"/v1/jobs/{job_id}/events"))
                assert stream.status_code == 200
            for api in (a, b):  # a third is refused by either
                with api.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true"}) as refused:
                    assert refused.status_code == 429, refused.read()
        # Closed, their slots are free again, on either.
        with b.stream("GET", f"/v1/jobs/{job_id}/events") as again:
            assert again.status_code == 200
            lines = again.iter_lines()
            seen = [int(line.removeprefix("id:")) for line in itertools.islice((line for line in lines if line.startswith("id:")), 2)]
            # Told to stop, a process ends its followed streams (without END: they resume on the
            # other process) instead of serving them until their jobs end: a rolling restart hung.
            second_process.terminate()
            rest = list(lines)
        assert "event: end" not in rest
        assert second_process.wait(timeout=60) == -signal.SIGTERM  # shut down, then the signal raised again, as uvicorn does
        seen += [int(line.removeprefix("id:")) for line in rest if line.startswith("id:")]
        with a.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(seen[-1])}) as resumed:
            assert event_ids(resumed, stop_after=1)[0] == seen[-1] + 1
        a.post(f"/v1/jobs/{job_id}/cancel")


def event_ids(response: httpx.Response, stop_after: int | None = None) -> list[int]:
    ids = []
    for line in response.iter_lines():
        if line.startswith("id:"):
            ids.append(int(line.removeprefix("id:").strip()))
            if stop_after is not None and len(ids) >= stop_after:
                break
    return ids


def test_a_follower_moved_to_the_other_api_process_misses_no_event_and_nginx_serves_through_either(two_apis):
    first, second, proxy, token, second_process = two_apis
    with client(first, token) as a, client(second, token) as b, client(proxy, token) as through_nginx:
        job_id = through_nginx.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 40, "checkpoint.every_steps": 10})).json()["id"]
        # Followed on one process for a few events, then cut; resumed on the other with Last-Event-ID.
        with a.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
            before = event_ids(stream, stop_after=3)
        with b.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(before[-1])}) as stream:
            after = event_ids(stream)  # until the job ends and the stream with it
        job = wait_for(through_nginx, job_id, {"succeeded", "failed", "cancelled"})
        assert job["status"] == "succeeded", job["failure_reason"]
        with a.stream("GET", f"/v1/jobs/{job_id}/events", params={"follow": "false"}) as stream:
            everything = event_ids(stream)
        assert before + after == everything and len(everything) == len(set(everything)) > 40  # none missed, none twice

        # Every route through nginx, and with one API process gone, through the other.
        for _ in range(4):
            assert through_nginx.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss"}).status_code == 200
        stop_children([second_process])
        for _ in range(4):
            assert through_nginx.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
            assert through_nginx.get("/v1/workers").status_code == 200
