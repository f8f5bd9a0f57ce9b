"""The `trainyard` command."""

from __future__ import annotations

import argparse
import sys

from trainyard.client_cli import add_client_commands
from trainyard.server_cli import add_server_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainyard", description="Run distributed PyTorch training jobs.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_server_commands(subparsers)
    add_client_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
