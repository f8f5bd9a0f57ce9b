"""The README's commands, run as written, in order, as a new user would from a fresh clone.

Every `bash` line and every `python` snippet of README.md runs, unless SKIPPED below names it with
the reason it can't run here: a command added to the README runs by default. They run in a
temporary "clone" (the repository's files linked in, this test's `.venv`) against the embedded
stack that the README's own `trainyard up` starts on port 8000.

The one change from a fresh clone: examples/shakespeare-char.json trains 40 steps instead of 2000
(every step count a fiftieth, through the spec's own fields) and each evaluation reads 4 batches
instead of 20 (on the one core a job's slot holds, 20 cost as much as 13 training steps), so the
jobs take seconds, not minutes on 2 cores; the checkpoints are still 4, of which `keep_last: 2` keeps ids 3 and 4.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(600)

README = REPO / "README.md"
COMMAND_TIMEOUT_S = 300
UP_READY_LINE = "Trainyard is up at"

# A command by its words without the comment (as " ".join(shlex.split(line, comments=True))).
SKIPPED_COMMANDS = {
    "make demo": "installs into .venv and runs the demo's own stack on :8000 for minutes; its logic is tests/client/test_demo.py",
    "make test": "is the run this test is part of",
}
# A whole block by its first command: what it shows needs what this machine hasn't.
SKIPPED_BLOCKS = {
    ".venv/bin/trainyard up &": "train.py stands for the reader's own script (examples/'s scripts run as jobs in tests/e2e/test_scripts.py)",
    "export TRAINYARD_DATABASE_URL=postgresql+psycopg://trainyard:pass@db:5432/trainyard":
        "production mode: PostgreSQL and Redis at docker-compose.yml's hosts `db` and `redis`, /shared volumes, a GPU",
    "export TRAINYARD_SLURM_PARTITION=gpu TRAINYARD_SLURM_ACCOUNT=ml-team":
        "a Slurm cluster's login node and its `gpu` partition (tests/e2e/test_slurm.py runs the pool on a throwaway cluster)",
    "scontrol token username=trainyard lifespan=604800 > /etc/trainyard/slurm.jwt":
        "a Slurm cluster's admin making a token, and its slurmrestd (tests/e2e/test_slurm.py reaches a throwaway cluster's this way)",
}


SHELL = ("bash", "sh", "shell")


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def readme_steps(text: str) -> list[tuple[str, str]]:
    """("bash", line) for each command line of a shell block, ("python", code) for each Python block,
    in order, leaving out SKIPPED_COMMANDS and SKIPPED_BLOCKS."""
    steps = []
    for language, body in readme_blocks(text):
        if language in SHELL:
            lines = [line for line in body.replace("\\\n", " ").splitlines() if words(line)]
            if words(lines[0]) not in SKIPPED_BLOCKS:
                steps += [("bash", line) for line in lines if words(line) not in SKIPPED_COMMANDS]
        elif language == "python":
            steps.append(("python", body))
    return steps


def words(line: str) -> str:
    return " ".join(shlex.split(line, comments=True))


def is_trainyard_up(line: str) -> bool:
    return words(line) == ".venv/bin/trainyard up"


def test_the_skip_lists_name_only_what_the_readme_has():
    text = README.read_text()
    shell = [body for language, body in readme_blocks(text) if language in SHELL]
    commands = {words(line) for body in shell for line in body.splitlines()}
    assert set(SKIPPED_COMMANDS) <= commands and set(SKIPPED_BLOCKS) <= commands, "a skip names a command the README no longer has"
    run = [words(code) for kind, code in readme_steps(text) if kind == "bash"]
    assert run[:2] == [".venv/bin/trainyard up", ".venv/bin/trainyard submit examples/shakespeare-char.json --follow"], run


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A directory laid out as a fresh clone, outside the repository: its files linked, `.venv` this
    test's environment, examples/ copied with the shortened job (module docstring)."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for entry in REPO.iterdir():
        # Dot entries are git's, the venv, and local state (.trainyard/): a fresh clone has none of its own.
        if not entry.name.startswith(".") and entry.name != "examples":
            (clone / entry.name).symlink_to(entry)
    (clone / ".venv").symlink_to(sys.prefix)
    shutil.copytree(REPO / "examples", clone / "examples")
    example = clone / "examples" / "shakespeare-char.json"
    spec = json.loads(example.read_text())
    assert (spec["training"]["max_steps"], spec["checkpoint"]["every_steps"]) == (2000, 500), "the README's numbers changed"
    spec["training"].update(max_steps=40, eval_every=spec["training"]["eval_every"] // 25, eval_batches=spec["training"]["eval_batches"] // 5)
    spec["checkpoint"]["every_steps"] = 10
    spec["schedule"]["warmup_steps"] //= 50
    example.write_text(json.dumps(spec, indent=2))
    return clone


def user_environment(tmp_path: Path) -> dict[str, str]:
    """This environment without Trainyard's settings and with a home of its own: a token or config
    file of the person running the tests must not stand in for the one `trainyard up` writes."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("TRAINYARD_")}
    home = tmp_path / "home"
    home.mkdir()
    env["HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"  # `trainyard up`'s ready line arrives while it runs, not at its exit
    return env


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def wait_until_up(process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while UP_READY_LINE not in log.read_text():
        assert process.poll() is None, f"`trainyard up` exited {process.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"`trainyard up` not up after {timeout} s:\n{log.read_text()}"
        time.sleep(0.2)


def test_every_readme_command_runs_as_written(clone: Path, tmp_path: Path):
    assert port_is_free(8000), "port 8000 is taken: the README's commands run `trainyard up` on it"
    env = user_environment(tmp_path)
    up: subprocess.Popen | None = None
    up_log = tmp_path / "trainyard-up.log"
    try:
        for number, (kind, code) in enumerate(readme_steps(README.read_text())):
            if kind == "bash" and is_trainyard_up(code):
                # It stays running, as the README says: the other commands are the user's second terminal.
                assert up is None, "the README starts `trainyard up` twice"
                with open(up_log, "w") as log:
                    up = subprocess.Popen(["bash", "-c", code], cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
                wait_until_up(up, up_log)
                continue
            if kind == "python":
                snippet = clone / f"readme_snippet_{number}.py"
                snippet.write_text(code)
                command = [str(clone / ".venv" / "bin" / "python"), snippet.name]
            else:
                command = ["bash", "-c", code]
            result = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            assert result.returncode == 0, f"README command failed ({result.returncode}):\n{code}\n{result.stdout}\n{result.stderr}"

        assert up is not None, "the README's quick start no longer starts `trainyard up`"
        # What the quick start promised: the jobs trained (submit --follow exits 1 otherwise) and
        # their checkpoints were downloaded where the commands said.
        assert (clone / "model.safetensors").stat().st_size > 0 and (clone / "model-2.safetensors").stat().st_size > 0

        os.killpg(up.pid, signal.SIGINT)  # "Ctrl-C stops everything": to the terminal's whole foreground group
        try:
            assert up.wait(60) == 0, up_log.read_text()
        except subprocess.TimeoutExpired:  # which process holds it up, and what each said last
            left = subprocess.run(["ps", "-o", "pid,stat,etime,args", "-g", str(up.pid)], capture_output=True, text=True).stdout
            logs = {log.name: log.read_text()[-1500:] for log in (clone / ".trainyard" / "logs").glob("*.log")}
            raise AssertionError(f"`trainyard up` still running 60 s after Ctrl-C:\n{left}\n{up_log.read_text()}\n{logs}") from None
        assert port_is_free(8000), "`trainyard up` left its API running"
    finally:
        if up is not None and up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
