"""`trainyard up` where it can't run: a second one on the same folder, a taken port. Refused at
once, saying why and what to do, with nothing started (a second stack on one folder used to print
"Trainyard is up" while its API failed to bind, and on exit deleted the first one's worker host).
And where it can: in a user's project whose packages share names with Trainyard's."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone

import httpx
import psutil
import pytest

from stack.embedded import StackRefused, _sole_stack_on, embedded_stack
from tests.e2e.test_end_to_end import wait_for
from tests.helpers import tiny_spec
from workers.supervisor import free_port


def test_a_second_trainyard_up_on_the_same_folder_is_refused_saying_where_the_first_runs(tmp_path):
    data_dir = tmp_path / ".trainyard"
    data_dir.mkdir()
    (data_dir / "server").write_text("http://127.0.0.1:8000\n")
    with _sole_stack_on(data_dir):  # as the first `trainyard up` holds it
        second = subprocess.run([sys.executable, "-m", "trainyard", "up", "--data-dir", str(data_dir), "--port", str(free_port())],
                                capture_output=True, text=True, timeout=60)
    assert second.returncode == 1, second
    assert "already running" in second.stderr and "http://127.0.0.1:8000" in second.stderr and "Traceback" not in second.stderr
    assert not (data_dir / "logs").exists()  # nothing was started


def test_up_starts_a_killed_process_again_and_its_processes_end_with_it_even_when_it_is_killed(tmp_path):
    # Found by a new user: a worker killed with -9 stayed dead, its job queued for ever ("waiting for
    # a worker host"); and `up` killed with -9 left its API, scheduler and worker running, beside
    # which a second `up` on another port started a second stack on the same folder.
    data_dir, port = tmp_path / ".trainyard", free_port()
    command = [sys.executable, "-m", "trainyard", "up", "--data-dir", str(data_dir), "--port", str(port), "--devices", "cpu:1"]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    children: list[psutil.Process] = []
    try:
        assert "Trainyard is up" in up.stdout.readline()
        children = psutil.Process(up.pid).children()
        worker = next(child for child in children if "worker" in child.cmdline())
        killed_at = datetime.now(timezone.utc)
        worker.kill()
        headers = {"Authorization": f"Bearer {(data_dir / 'token').read_text().strip()}"}
        deadline = time.monotonic() + 60
        while not [host for host in httpx.get(f"http://127.0.0.1:{port}/v1/workers", headers=headers).json()
                   if datetime.fromisoformat(host["last_heartbeat"]) > killed_at]:  # registered again
            assert time.monotonic() < deadline, "the killed worker was not started again"
            time.sleep(0.5)
        children = psutil.Process(up.pid).children()
        assert len(children) == 3 and worker.pid not in {child.pid for child in children}
        up.kill()
        _, still_running = psutil.wait_procs(children, timeout=30)
        assert still_running == []
        assert "the worker-0 process exited (code -9); starting it again" in up.stderr.read()
        # The folder is free again once they are gone; `up` without --port takes the port it ran on.
        up = subprocess.Popen(command[:-4] + command[-2:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert f"Trainyard is up at http://127.0.0.1:{port}" in up.stdout.readline()
        children = psutil.Process(up.pid).children()
        up.terminate()
        assert up.wait(timeout=60) == 0
    finally:
        up.kill()
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()


def test_bad_options_of_up_are_refused_saying_why():
    for option, says in ((["--port", "99999"], "a port is a number from 1 to 65535"), (["--devices", "cpu:0"], "expected cpu:N with N >= 1"),
                         (["--workers", "-1"], "a number of worker hosts, 0 or more")):
        refused = subprocess.run([sys.executable, "-m", "trainyard", "up", *option], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and says in refused.stderr and "Traceback" not in refused.stderr, refused.stderr


def test_a_taken_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StackRefused, match=f"port {port} is taken"):
            with embedded_stack(tmp_path / "yard", port):
                pass
    assert not (tmp_path / "yard" / "logs").exists()
    with _sole_stack_on(tmp_path / "yard"):  # and the folder's lock was let go
        pass


def test_up_in_a_project_with_packages_named_like_trainyards_runs_a_job(tmp_path, monkeypatch):
    project = tmp_path / "project"  # a user's own `common/`, `workers/`…: never imported in their stead
    for package in ("common", "workers", "service", "api_schemas", "stack", "trainyard"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(f"raise ImportError('the project\\'s own {package}, not Trainyard\\'s')\n")
    monkeypatch.chdir(project)
    with embedded_stack(project / ".trainyard", free_port()) as info:
        # One connection, kept alive: idle past uvicorn's default keep-alive (5 s, a heartbeat's
        # period) it still serves its next request (stack/cli.KEEP_ALIVE_SECONDS). Closed under
        # it, the request failed: "Server disconnected without sending a response".
        host, port = info.url.removeprefix("http://").split(":")
        idle = http.client.HTTPConnection(host, int(port), timeout=30)
        opened = time.monotonic()
        assert healthz_on(idle) == 200
        first_socket = idle.sock
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            job = client.post("/v1/jobs", json=tiny_spec()).json()
            assert wait_for(client, job["id"], {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"
        time.sleep(max(0.0, 7 - (time.monotonic() - opened)))
        assert healthz_on(idle) == 200 and idle.sock is first_socket
        idle.close()


def healthz_on(connection: http.client.HTTPConnection) -> int:
    """GET /healthz on `connection` (http.client sends it on the socket it holds, reopening none)."""
    connection.request("GET", "/healthz")
    response = connection.getresponse()
    response.read()
    return response.status
