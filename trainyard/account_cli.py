"""`trainyard token rotate`, `trainyard open`, `trainyard usage` and `trainyard audit`: a user's token and browser, and who used what."""

from __future__ import annotations

import argparse
import sys
import webbrowser
from datetime import datetime

import yaml

from trainyard.client import config_file, read_config, token_file
from trainyard.client_cli import connect, guarded, local_time, positive, print_table


def local_moment(text: str) -> datetime:
    """An ISO 8601 time from the command line; without a zone, the local one."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a time such as 2026-11-01 or 2026-11-01T09:30 (ISO 8601), not {text!r}") from None
    return moment if moment.tzinfo else moment.astimezone()


def cmd_token_rotate(args: argparse.Namespace) -> int:
    with connect(args) as client:
        source = client.token_source
        new = client.rotate_token()
    # The old token no longer works: write the new one where this one was read from, or show it.
    if source == "file":
        path = token_file()
        path.write_text(new.token + "\n")
        path.chmod(0o600)
        where = f"written to {path}"
    elif source == "config":
        path = config_file()
        path.write_text(yaml.safe_dump({**read_config(), "token": new.token}))
        path.chmod(0o600)
        where = f"written to {path}"
    else:
        print(new.token)
        where = "printed above; set it where the old one was (TRAINYARD_TOKEN or --token)"
    expiry = f", valid until {local_time(new.expires_at)}" if new.expires_at else ""
    print(f"new token {where}{expiry}; the old one no longer works", file=sys.stderr)
    return 0


def cmd_open(args: argparse.Namespace) -> int:
    with connect(args) as client:
        link, expires_at = client.login_link()
    # The link works once, for minutes: printed, for a browser on another machine, and opened here.
    print(link)
    print(f"signs a browser in once, until {local_time(expires_at)}; the page keeps its own session, never your token", file=sys.stderr)
    if not args.no_browser:
        webbrowser.open(link)
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    with connect(args) as client:
        found = client.usage(since=args.since, limit=args.limit)
    period = f"since {local_time(found.since)}" if found.since else "since the beginning"
    print(f"device-hours (processes × hours run) {period}, until {local_time(found.until)}")
    print_table(["USER", "JOBS", "DEVICE-HOURS"], [[u.user, u.jobs, f"{u.device_seconds / 3600:.3f}"] for u in found.users])
    if any(t.team for t in found.teams):
        print()
        print_table(["TEAM", "JOBS", "DEVICE-HOURS"], [[t.team or "(no team)", t.jobs, f"{t.device_seconds / 3600:.3f}"] for t in found.teams])
    if found.jobs:
        print()
        print_table(["JOB", "NAME", "OWNER", "DEVICE-HOURS"], [[j.job_id, j.name, j.owner, f"{j.device_seconds / 3600:.3f}"] for j in found.jobs])
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    with connect(args) as client:
        entries = list(client.audit(user=args.user, since=args.since, limit=args.limit))
    print_table(
        ["WHEN", "USER", "FROM", "REQUEST", "ANSWER", "JOB", "WHAT"],
        [[local_time(e.at), e.user or "-", e.client_address, f"{e.method} {e.path}", e.status_code, e.job_id or "-", e.detail or "-"] for e in entries],
    )
    return 0


def add_account_commands(subparsers, connection: argparse.ArgumentParser) -> None:
    token = subparsers.add_parser("token", help="your API token")
    token_commands = token.add_subparsers(dest="token_command", required=True)
    rotate = token_commands.add_parser(
        "rotate", parents=[connection], help="replace your token with a new one (the old one stops working); stored where the old one was found"
    )
    rotate.set_defaults(func=guarded(cmd_token_rotate))

    open_page = subparsers.add_parser("open", parents=[connection], help="open the dashboard, signed in by a one-time link (printed too)")
    open_page.add_argument("--no-browser", action="store_true", help="only print the link")
    open_page.set_defaults(func=guarded(cmd_open))

    usage = subparsers.add_parser("usage", parents=[connection], help="device-hours per user and job (yours; everyone's for an admin)")
    usage.add_argument("--since", type=local_moment, help="count from this time (ISO 8601, e.g. 2026-11-01)")
    usage.add_argument("--limit", type=positive, default=20, help="jobs to list (default 20)")
    usage.set_defaults(func=guarded(cmd_usage))

    audit = subparsers.add_parser("audit", parents=[connection], help="who did what, when, from where (admins only)")
    audit.add_argument("--user", help="only this user's requests")
    audit.add_argument("--since", type=local_moment, help="only from this time (ISO 8601)")
    audit.add_argument("--limit", type=positive, default=50, help="entries to show (default 50)")
    audit.set_defaults(func=guarded(cmd_audit))
