"""`trainyard up` where it can't run: a second one on the same folder, a taken port. Refused at
once, saying why and what to do, with nothing started (a second stack on one folder used to print
"Trainyard is up" while its API failed to bind, and on exit deleted the first one's worker host).
And where it can: in a user's project whose packages share names with Trainyard's."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import time

import httpx
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
        second = subprocess.run([sys.executable, "-m", "trainyard", "up", "--data-dir", str(data_dir), "--port", "0"],
                                capture_output=True, text=True, timeout=60)
    assert second.returncode == 1, second
    assert "already running" in second.stderr and "http://127.0.0.1:8000" in second.stderr and "Traceback" not in second.stderr
    assert not (data_dir / "logs").exists()  # nothing was started


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
