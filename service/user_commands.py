"""`trainyard user create|set|revoke|rotate` and `trainyard host token|revoke`: an admin's commands
for users, worker hosts and their tokens, run on a host that reaches the database. Each is written
to the audit trail as the OS account that ran it."""

from __future__ import annotations

import argparse
import getpass
import re
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from api_schemas.accounts import USER_NAME_PATTERN
from api_schemas.host_api import HOST_NAME_PATTERN
from common.settings import Settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


class CommandError(Exception):
    """What the command prints as `error: …`, exiting 1."""


@contextmanager
def admin_session(settings: Settings) -> Iterator[Session]:
    """A session on the service's database; a missing embedded database is an error that says where
    it looked, not a traceback."""
    from sqlalchemy.engine import make_url  # here: the module is imported by every server command, a Slurm node's agent too

    from service.db.session import session_factory

    url = settings.resolved_database_url
    database = make_url(url).database
    if url.startswith("sqlite") and database and not Path(database).exists():
        raise CommandError(
            f"no Trainyard database at {database}: run this where `trainyard up` ran (or below), "
            "or set TRAINYARD_DATA_DIR or TRAINYARD_DATABASE_URL"
        )
    from service.db.migrate import SchemaNotReady, check_schema

    try:
        check_schema(url)
    except SchemaNotReady as exc:
        raise CommandError(str(exc)) from None
    with session_factory(url)() as session:
        yield session


def _audited(session: Session, action: str, noun: str = "user") -> None:
    from service.db.audit import record

    record(
        session, user_id=None, user_name=f"{getpass.getuser()} (server CLI)", client_address=socket.gethostname()[:100],
        method="CLI", path=f"trainyard {noun} {action}"[:500], status_code=200, detail=action[:500],
    )


def create(args: argparse.Namespace, session: Session) -> str:
    from service.db.accounts import create_user, user_by_name

    if user_by_name(session, args.name):
        raise CommandError(f"user {args.name!r} already exists (`trainyard user set` changes its permissions)")
    lifetime = timedelta(days=args.token_lifetime_days) if args.token_lifetime_days else None
    _, token = create_user(session, args.name, is_admin=args.admin, can_run_code=args.can_run_code, token_lifetime=lifetime)
    _audited(session, f"create {args.name}" + (" --admin" if args.admin else "") + (" --can-run-code" if args.can_run_code else ""))
    return token


def list_users(args: argparse.Namespace, session: Session) -> str:
    """Every user, with what it may do and whether its token works: what an operator checks before `set` or `revoke`."""
    from sqlalchemy import select

    from service.db.models import User

    def token(user: User) -> str:
        if user.revoked_at is not None:
            return f"revoked {user.revoked_at:%Y-%m-%d}"
        return f"expires {user.token_expires_at:%Y-%m-%d %H:%M}" if user.token_expires_at else "never expires"

    rows = [["NAME", "ADMIN", "CAN RUN CODE", "TOKEN", "CREATED"]] + [
        [user.name, "yes" if user.is_admin else "-", "yes" if user.can_run_code else "-", token(user), f"{user.created_at:%Y-%m-%d}"]
        for user in session.scalars(select(User).order_by(User.name))
    ]
    return _table(rows)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def set_permissions(args: argparse.Namespace, session: Session) -> str:
    user = _named(session, args.name)
    changes = {name: value for name, value in (("is_admin", args.admin), ("can_run_code", args.can_run_code)) if value is not None}
    if not changes:
        raise CommandError("nothing to set: give --admin/--no-admin or --can-run-code/--no-can-run-code")
    for name, value in changes.items():
        setattr(user, name, value)
    session.commit()
    _audited(session, f"set {args.name} " + " ".join(f"{name}={value}" for name, value in changes.items()))
    return f"{args.name}: admin {user.is_admin}, can_run_code {user.can_run_code}"


def revoke(args: argparse.Namespace, session: Session) -> str:
    from service.db.accounts import revoke as revoke_user

    revoke_user(session, _named(session, args.name))
    _audited(session, f"revoke {args.name}")
    return f"{args.name}'s token no longer works; `trainyard user rotate {args.name}` issues a new one"


def rotate(args: argparse.Namespace, session: Session) -> str:
    from service.db.accounts import rotate_token

    token, expires_at = rotate_token(session, _named(session, args.name))
    _audited(session, f"rotate {args.name}")
    if expires_at is not None:
        print(f"valid until {expires_at.isoformat(timespec='seconds')}", file=sys.stderr)
    return token


def host_token(args: argparse.Namespace, session: Session) -> str:
    from service.db.host_tokens import issue_host_token

    token = issue_host_token(session, args.name)
    _audited(session, f"token {args.name}", "host")
    print(f"give it to the worker as TRAINYARD_HOST_TOKEN (or in the file TRAINYARD_HOST_TOKEN_FILE names); "
          f"it acts as host {args.name} only, and replaces any earlier token of it", file=sys.stderr)
    if args.output is None:
        return token
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.touch(mode=0o600)
    args.output.write_text(token + "\n")
    return f"host {args.name}'s token written to {args.output}"


def host_list(args: argparse.Namespace, session: Session) -> str:
    """Every host token, whether it works, and whether its host is in the pool: GET /v1/workers lists
    the registered hosts only (a revoked host leaves the pool, a new one has not joined yet)."""
    from sqlalchemy import select

    from service.db.models import HostToken, WorkerHost

    registered = {host.name: host for host in session.scalars(select(WorkerHost))}
    rows = [["HOST", "TOKEN", "ISSUED", "IN THE POOL"]]
    for token in session.scalars(select(HostToken).order_by(HostToken.host_name)):
        host = registered.get(token.host_name)
        rows.append([
            token.host_name, f"revoked {token.revoked_at:%Y-%m-%d %H:%M}" if token.revoked_at else "works", f"{token.created_at:%Y-%m-%d %H:%M}",
            f"last heartbeat {host.last_heartbeat:%Y-%m-%d %H:%M:%S}" if host else "-",
        ])
    return _table(rows) if len(rows) > 1 else "no host tokens yet: `trainyard host token NAME` makes one"


def host_revoke(args: argparse.Namespace, session: Session) -> str:
    from service.db.host_tokens import revoke_host_token

    if not revoke_host_token(session, args.name):
        raise CommandError(f"host {args.name!r} has no token in use")
    _audited(session, f"revoke {args.name}", "host")
    return f"host {args.name}'s token no longer works: its attempts are lost and requeued; `trainyard host token {args.name}` issues a new one"


def _named(session: Session, name: str):
    from service.db.accounts import user_by_name

    if (user := user_by_name(session, name)) is None:
        raise CommandError(f"no user {name!r}")
    return user


def _lifetime_days(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_LIFETIME_DAYS:  # a date past year 9999 can't be stored: it was a traceback
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_LIFETIME_DAYS:,} (leave it out: never), not {text}")
    return value


MAX_LIFETIME_DAYS = 36_500


def _name_of_a(what: str, pattern: str, punctuation: str) -> Callable[[str], str]:
    """argparse's type for a new user's or host's name: refused here, before it is stored."""
    def check(text: str) -> str:
        if not re.fullmatch(pattern, text):
            raise argparse.ArgumentTypeError(f"{text!r}: a {what} name is letters, digits and {punctuation}, starting with a letter or digit")
        return text
    return check


user_name = _name_of_a("user", USER_NAME_PATTERN, ". _ @ + -")
host_name = _name_of_a("host", HOST_NAME_PATTERN, ". _ -")


def add_user_commands(parser: argparse.ArgumentParser, settings: Callable[[], Settings]) -> None:
    commands = parser.add_subparsers(dest="user_command", required=True)

    def command(name: str, action: Callable[[argparse.Namespace, Session], str], help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help)
        sub.add_argument("name", type=user_name if action is create else str)
        sub.set_defaults(func=lambda args: run(action, args, settings()))
        return sub

    new = command("create", create, "create a user and print its token")
    new.add_argument("--admin", action="store_true")
    new.add_argument("--can-run-code", action="store_true", help="may submit `script` jobs and `environment.pip`, which run the user's own code on worker hosts")
    new.add_argument(
        "--token-lifetime-days", type=_lifetime_days, help="each token of this user stops working this many days after it is issued (default: never)"
    )
    change = command("set", set_permissions, "change a user's permissions")
    change.add_argument("--admin", action=argparse.BooleanOptionalAction, default=None)
    change.add_argument("--can-run-code", action=argparse.BooleanOptionalAction, default=None)
    command("revoke", revoke, "stop a user's token from working (until `user rotate`)")
    listing = commands.add_parser("ls", help="every user: admin, may run code, whether its token works")
    listing.set_defaults(func=lambda args: run(list_users, args, settings()))
    command("rotate", rotate, "print a new token for a user (a revoked one too); the old one stops working")


def add_host_commands(parser: argparse.ArgumentParser, settings: Callable[[], Settings]) -> None:
    commands = parser.add_subparsers(dest="host_command", required=True)
    for name, action, help in (
        ("token", host_token, "print a new token for a worker host (its only credential: the worker protocol over HTTP)"),
        ("revoke", host_revoke, "stop a host's token from working: its attempts are lost and requeued, as a dead host's"),
        ("list", host_list, "every host token: whether it works, and whether its host is in the pool"),
    ):
        sub = commands.add_parser(name, help=help)
        if action is not host_list:
            sub.add_argument("name", type=host_name if action is host_token else str, help="the host's name (its worker's --host-name)")
        sub.set_defaults(func=lambda args, action=action: run(action, args, settings()))
        if action is host_token:
            sub.add_argument("--output", type=Path, help="write the token to this file (0600) instead of printing it")


def run(action: Callable[[argparse.Namespace, Session], str], args: argparse.Namespace, settings: Settings) -> int:
    try:
        with admin_session(settings) as session:
            print(action(args, session))
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
