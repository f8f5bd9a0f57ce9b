"""A worker host starting up on the embedded broker: nothing can be sent to it before its queue exists.

The scheduler sends to a host as soon as the host is registered. On the SQLAlchemy transport,
sending to a queue and declaring it both create its row (a SELECT, then an INSERT); when the two
met, the worker's Celery consumer failed on the unique name and stopped for good: a two-node job
placed on that host at once never started (seen in tests/e2e/test_multihost_netns.py).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import httpx

from common.settings import Settings
from service.db.host_tokens import revoke_host_token
from service.db.session import session_factory
from stack.embedded import embedded_stack, host_token_files, prepare_embedded, stop_children, wait_healthy
from tests.helpers import tiny_spec
from workers.supervisor import free_port


def rows(database: str, query: str) -> list[tuple]:
    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as connection:
            return connection.execute(query).fetchall()
    except sqlite3.OperationalError:  # the file or table is not made yet
        return []


def api_and_host_token(data_dir, host: str) -> tuple[str, int, dict, subprocess.Popen]:
    """An embedded API started on a free port, and a token file for `host`: (token file, port, the
    processes' environment, the API's process)."""
    settings = Settings(data_dir=data_dir)
    prepare_embedded(settings)
    [token_file] = host_token_files(settings, [host])
    port = free_port()
    env = {**os.environ, "TRAINYARD_DATA_DIR": str(data_dir)}
    api = subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return str(token_file), port, env, api


def test_a_worker_host_is_registered_only_once_its_queue_exists(tmp_path):
    token_file, port, env, api = api_and_host_token(tmp_path, "fresh")
    worker = subprocess.Popen(
        [sys.executable, "-m", "trainyard", "worker", "--host-name", "fresh", "--devices", "cpu:1"],
        env={**env, "TRAINYARD_API_URL": f"http://127.0.0.1:{port}", "TRAINYARD_HOST_TOKEN_FILE": str(token_file)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        # Watch for the moment the scheduler could first see the host.
        deadline = time.monotonic() + 60
        while not rows(str(tmp_path / "trainyard.db"), "SELECT name FROM worker_hosts WHERE name = 'fresh'"):
            assert worker.poll() is None, "the worker exited during start-up"
            assert time.monotonic() < deadline, "the worker never registered"
            time.sleep(0.002)
        queues = rows(str(tmp_path / "broker.db"), "SELECT name FROM kombu_queue")
        assert ("host.fresh",) in queues
    finally:
        stop_children([worker, api])


def test_a_worker_without_a_host_token_says_how_to_get_one(tmp_path):
    env = {**os.environ, "TRAINYARD_DATA_DIR": str(tmp_path)}
    env.pop("TRAINYARD_HOST_TOKEN", None)
    done = subprocess.run([sys.executable, "-m", "trainyard", "worker", "--host-name", "h", "--devices", "cpu:1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no host token" in done.stderr and "trainyard host token NAME" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_set_up_apart_from_the_service_says_what_it_lacks(tmp_path):
    """A host started where the admin forgot a setting: told which, at start, not a traceback nor a job
    failed later (its checkpoints refused for ever, its jobs' data not found)."""
    service_dir, host_dir = tmp_path / "service", tmp_path / "host"
    settings = Settings(data_dir=service_dir)
    prepare_embedded(settings)
    [token_file] = host_token_files(settings, ["node-1"])
    port = free_port()
    api = subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--port", str(port)], env={**os.environ, "TRAINYARD_DATA_DIR": str(service_dir)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host = {**os.environ, "TRAINYARD_DATA_DIR": str(host_dir), "TRAINYARD_API_URL": f"http://127.0.0.1:{port}", "TRAINYARD_HOST_TOKEN_FILE": str(token_file)}
    host.pop("TRAINYARD_BROKER_URL", None)

    def start(**env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trainyard", "worker", "--host-name", "node-1", "--devices", "cpu:1"],
                              env={**host, **env}, capture_output=True, text=True, timeout=120)

    try:
        no_broker = start()
        assert no_broker.returncode == 2 and "no broker: TRAINYARD_BROKER_URL is not set" in no_broker.stderr, no_broker.stderr
        # The broker given, but its own artifact store where the API's is not mounted.
        elsewhere = start(TRAINYARD_BROKER_URL=settings.resolved_broker_url)
        assert elsewhere.returncode == 2, elsewhere.stderr
        assert f"{host_dir / 'artifacts'} is not the service's artifact store" in elsewhere.stderr
        assert "set TRAINYARD_ARTIFACT_ROOT to where this host mounts the API's" in elsewhere.stderr
        # It had registered to learn what to check: it left again (else jobs were placed on it, and
        # the worker started again, set right, was refused as a second one under its name).
        assert not rows(str(service_dir / "trainyard.db"), "SELECT name FROM worker_hosts"), "the host that could not start is in the pool"
        # Another host's name with this token: it would consume a queue no job is sent to.
        renamed = subprocess.run([sys.executable, "-m", "trainyard", "worker", "--host-name", "node-2", "--devices", "cpu:1"],
                                 env={**host, "TRAINYARD_BROKER_URL": settings.resolved_broker_url}, capture_output=True, text=True, timeout=120)
        assert renamed.returncode == 2 and "this is host node-1's token, not node-2's: start the worker with --host-name node-1" in renamed.stderr, renamed.stderr
        # A URL that reaches a server, but no Trainyard API there: not blamed on the token.
        wrong_url = start(TRAINYARD_BROKER_URL=settings.resolved_broker_url, TRAINYARD_API_URL=f"http://127.0.0.1:{port}/trainyard")
        assert wrong_url.returncode == 2 and f"no Trainyard API at http://127.0.0.1:{port}/trainyard" in wrong_url.stderr, wrong_url.stderr
        assert "check TRAINYARD_API_URL" in wrong_url.stderr and "token" not in wrong_url.stderr
        assert "Traceback" not in no_broker.stderr + elsewhere.stderr + renamed.stderr + wrong_url.stderr
    finally:
        stop_children([api])


def test_an_idle_worker_retries_an_api_that_is_down_at_its_pace_and_stops_saying_why_once_its_token_is_revoked(tmp_path):
    settings = Settings(data_dir=tmp_path)
    prepare_embedded(settings)
    [token_file] = host_token_files(settings, ["node-1"])
    port = free_port()
    # An idle host heartbeats every third of the host timeout: 0.5 s here.
    env = {**os.environ, "TRAINYARD_DATA_DIR": str(tmp_path), "TRAINYARD_HEARTBEAT_SECONDS": "0.5", "TRAINYARD_HOST_TIMEOUT_SECONDS": "1.5"}
    api_command = [sys.executable, "-m", "trainyard", "api", "--port", str(port)]
    api = subprocess.Popen(api_command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "trainyard", "worker", "--host-name", "node-1", "--devices", "cpu:1"],
            env={**env, "TRAINYARD_API_URL": f"http://127.0.0.1:{port}", "TRAINYARD_HOST_TOKEN_FILE": str(token_file)}, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        # Up: registered (perhaps twice, the second time with its sandbox described) and heartbeating.
        while "host node-1 registered with" not in (tmp_path / "worker.log").read_text():
            assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.05)
        # The API down for 3 s: the worker tries again each heartbeat, not in a loop as fast as the
        # refusals come (a heartbeat overdue must not make the next one due at once).
        stop_children([api])
        time.sleep(3)
        api = subprocess.Popen(api_command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(f"http://127.0.0.1:{port}", [api])
        failed = (tmp_path / "worker.log").read_text().count("heartbeat failed")
        assert 2 <= failed <= 20, failed
        with session_factory(settings.resolved_database_url)() as session:
            assert revoke_host_token(session, "node-1")
        # Not a traceback every heartbeat for ever: it stops, and says why and what to do.
        worker.wait(timeout=60)
        said = (tmp_path / "worker.log").read_text()
        assert "the service refused this host's token (revoked, or replaced by `trainyard host token node-1`): stopping" in said, said
        assert "Traceback" not in said.split("stopping")[-1], said  # its deregistration, refused as well, is no error to dump
    finally:
        stop_children([worker, api])


def test_a_worker_stopped_as_it_starts_leaves_the_pool_and_starts_again_under_its_name_at_once(tmp_path):
    """Before Celery's worker is up (it leaves the pool on SIGTERM then), a stop killed the process
    still registered: jobs were placed on it, and the worker started again was refused as a second
    process under its name (409) until the host timed out, 30 s later."""
    token_file, port, env, api = api_and_host_token(tmp_path, "node-1")
    database, log_path = str(tmp_path / "trainyard.db"), tmp_path / "worker.log"

    def start_worker() -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "trainyard", "worker", "--host-name", "node-1", "--devices", "cpu:1"],
                env={**env, "TRAINYARD_API_URL": f"http://127.0.0.1:{port}", "TRAINYARD_HOST_TOKEN_FILE": str(token_file)},
                stdout=log, stderr=subprocess.STDOUT,
            )

    worker = start_worker()
    try:
        deadline = time.monotonic() + 60
        while not rows(database, "SELECT name FROM worker_hosts WHERE name = 'node-1'"):  # registered: stopped at once
            assert worker.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.01)
        stop_children([worker])
        assert worker.returncode == 128 + signal.SIGTERM, log_path.read_text()  # ended by its own hand, not killed late
        assert not rows(database, "SELECT name FROM worker_hosts WHERE name = 'node-1'"), "the stopped host is still in the pool"

        before = len(log_path.read_text())
        worker = start_worker()
        while "host node-1 registered with" not in (said := log_path.read_text()[before:]):
            assert worker.poll() is None and time.monotonic() < deadline, said
            time.sleep(0.05)
        assert "cannot register yet" not in said
    finally:
        stop_children([worker, api])


def test_a_worker_stopped_while_the_api_is_down_ends_once_its_lease_is_over_not_never(tmp_path, monkeypatch):
    """It retried the attempt's end every 2 s for ever, a traceback each time, until killed: past a
    lease of silence the service has taken the attempt for lost, and nothing left can be delivered."""
    monkeypatch.setenv("TRAINYARD_LEASE_SECONDS", "6")
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "1")
    with embedded_stack(tmp_path / "yard", free_port(), workers=1) as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            job_id = client.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 10**6, "checkpoint.every_steps": 20})).json()["id"]
            deadline = time.monotonic() + 120
            while client.get(f"/v1/jobs/{job_id}").json()["step"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        info.stop("api")
        info.stop("worker-0")  # SIGTERM, then SIGKILL past 20 s
        assert info.exited()["worker-0"] == 0, "the worker did not stop by itself"
        said = (info.log_dir / "worker-0.log").read_text()
        assert "the host stopped while the service was out of reach for longer than the lease (6 s)" in said
        assert "Traceback" not in said
