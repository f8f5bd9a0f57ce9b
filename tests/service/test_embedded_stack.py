"""`trainyard up` where it can't run: a second one on the same folder, a taken port. Refused at
once, saying why and what to do, with nothing started (a second stack on one folder used to print
"Trainyard is up" while its API failed to bind, and on exit deleted the first one's worker host)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from stack.embedded import StackRefused, _sole_stack_on, embedded_stack


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
