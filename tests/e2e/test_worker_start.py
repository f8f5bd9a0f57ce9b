"""A worker host starting up on the embedded broker: nothing can be sent to it before its queue exists.

The scheduler sends to a host as soon as the host is registered. On the SQLAlchemy transport,
sending to a queue and declaring it both create its row (a SELECT, then an INSERT); when the two
met, the worker's Celery consumer failed on the unique name and stopped for good: a two-node job
placed on that host at once never started (seen in tests/e2e/test_multihost_netns.py).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

from stack.embedded import host_token_files, prepare_embedded, stop_children
from common.settings import Settings
from workers.supervisor import free_port


def rows(database: str, query: str) -> list[tuple]:
    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as connection:
            return connection.execute(query).fetchall()
    except sqlite3.OperationalError:  # the file or table is not made yet
        return []


def test_a_worker_host_is_registered_only_once_its_queue_exists(tmp_path):
    settings = Settings(data_dir=tmp_path)
    prepare_embedded(settings)
    [token_file] = host_token_files(settings, ["fresh"])
    port = free_port()
    env = {**os.environ, "TRAINYARD_DATA_DIR": str(tmp_path)}
    api = subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
