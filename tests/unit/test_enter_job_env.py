"""workers/enter_job_env.py as PID 1 of an attempt's PID namespace (bwrap --as-pid-1)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workers.enter_job_env
from tests.conftest import IN_CI

# A rank that answers SIGTERM with a checkpoint that takes a second to write, under a launcher that
# dies of the same SIGTERM at once, as Accelerate's single-process launcher does.
RANK = """
import pathlib, signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
pathlib.Path(sys.argv[1], "ready").touch()
while not stop:
    time.sleep(0.02)
time.sleep(1.0)
pathlib.Path(sys.argv[1], "saved").touch()
sys.exit(75)
"""
LAUNCHER = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]).wait()"


def test_asked_to_stop_the_namespaces_first_process_outlives_a_launcher_that_dies_before_its_rank_has_checkpointed(tmp_path: Path):
    if shutil.which("bwrap") is None:
        if IN_CI:
            pytest.fail("bubblewrap is not installed")
        pytest.skip("bubblewrap is not installed")
    env_file = tmp_path / "env.json"
    env_file.write_text(json.dumps({}))
    command = [
        "bwrap", "--unshare-pid", "--as-pid-1", "--dev-bind", "/", "/", "--proc", "/proc", "--",
        sys.executable, "-I", "-S", workers.enter_job_env.__file__, "--init", str(env_file), "--",
        sys.executable, "-c", LAUNCHER, RANK, str(tmp_path),
    ]
    # Its output is a pipe every process of the namespace holds, as the worker's supervisor reads it:
    # read to its end, it says they have all gone (bwrap itself exits on the SIGTERM at once).
    sandbox = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and sandbox.poll() is None, "the rank did not start"
        time.sleep(0.05)
    os.killpg(sandbox.pid, signal.SIGTERM)  # every process of the attempt at once, as a cluster's preemption does
    sandbox.communicate(timeout=30)
    assert (tmp_path / "saved").exists(), "the rank was killed before its checkpoint was written"
