"""`trainyard` runs the client's commands itself and hands the server's to the server package."""

from __future__ import annotations

import sys

import pytest

from trainyard.cli import SERVER_COMMANDS, main

CLIENT_COMMANDS = {"submit", "datasets", "ls", "status", "logs", "cancel", "checkpoints", "download", "outputs", "dashboard", "workers", "sweep", "compare",
                   "token", "open", "usage", "audit", "spec", "team", "record", "rerun", "diff"}


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_client_and_the_server_commands(capsys):
    out = help_of(["--help"], capsys)
    listed = out[out.index("{") + 1 : out.index("}")].split(",")
    assert set(listed) == CLIENT_COMMANDS | set(SERVER_COMMANDS)
    words = " ".join(out.split())  # argparse wraps long help lines
    assert all(help in words for help in SERVER_COMMANDS.values())


@pytest.mark.parametrize("name", SERVER_COMMANDS)
def test_each_server_command_reaches_the_server_parser(name, capsys):
    assert f"usage: trainyard {name}" in help_of([name, "--help"], capsys)


def test_a_server_command_without_the_server_package_says_so(monkeypatch, capsys):
    # What importing the server's commands does where the package is not installed.
    monkeypatch.delitem(sys.modules, "stack.cli", raising=False)
    monkeypatch.setitem(sys.modules, "stack", None)
    assert main(["up"]) == 1
    assert "`trainyard up` is a server command" in capsys.readouterr().err
