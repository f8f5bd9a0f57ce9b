"""The `trainyard` command: the client's commands, and the server's, which the server package runs.

The client needs none of the server: a server command is only named here, and its module is
imported when one is run, so the CLI works where only `api_schemas` and `trainyard` are installed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from trainyard.account_cli import add_account_commands
from trainyard.client_cli import EXIT_FAILED, add_client_commands, add_connection_options
from trainyard.compare_cli import add_compare_command
from trainyard.record_cli import add_record_commands
from trainyard.sweep_cli import add_sweep_commands
from trainyard.team_cli import add_team_commands

# Their options and handlers are in SERVER_CLI; the one-line help is here, for `trainyard --help`.
SERVER_COMMANDS = {
    "up": "run API, scheduler and local workers in one command (SQLite, no servers)",
    "api": "run the REST API",
    "scheduler": "run the scheduler",
    "worker": "run a worker host",
    "slurm-agent": "run one node of a Slurm pool's job (started by the batch script the scheduler submits)",
    "db": "database schema",
    "user": "users and tokens",
    "host": "worker hosts' tokens",
}
SERVER_CLI = "stack.cli"  # named, not imported: importing the client must not import the server


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainyard", description="Run distributed PyTorch training jobs.")
    add_connection_options(parser)  # before the command too: `trainyard --server URL ls`
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, help in SERVER_COMMANDS.items():
        subparsers.add_parser(name, help=help, add_help=False)  # listed; main() hands their arguments to SERVER_CLI
    connection = add_client_commands(subparsers)
    add_sweep_commands(subparsers, connection)
    add_compare_command(subparsers, connection)
    add_record_commands(subparsers, connection)
    add_account_commands(subparsers, connection)
    add_team_commands(subparsers, connection)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVER_COMMANDS:
        return run_server_command(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = ""
        if getattr(args, "script", None) is not None:  # `submit --script train.py --lr 3e-4`
            words = argv[argv.index(unknown[0]):]  # with the values argparse took for positionals
            hint = f" (a script's own arguments go after `--`: trainyard submit --script {args.script} -- {' '.join(words)})"
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    args.argv = argv  # as typed: what argparse doesn't keep (which words came after `--`)
    if args.command in SERVER_COMMANDS:  # reached only with options before it
        parser.error(f"`trainyard {args.command}` is a server command: give its options after it, and no --server or --token")
    try:
        return args.func(args)
    except BrokenPipeError:  # `trainyard ls | head`: the reader has gone, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush doesn't fail again
        return 0


def run_server_command(argv: list[str]) -> int:
    try:
        server_cli = importlib.import_module(SERVER_CLI)
    except ModuleNotFoundError as exc:
        if exc.name not in ("stack", "service", "workers", SERVER_CLI):
            raise  # the server is installed but broken: that traceback is the useful message
        print(f"error: `trainyard {argv[0]}` is a server command, and the Trainyard server (its `stack` and `service` packages) "
              "is not installed here; the client commands work without it", file=sys.stderr)
        return EXIT_FAILED
    return server_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
