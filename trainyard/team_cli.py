"""`trainyard team`: teams, their quotas and members (admins change them), and what each holds now."""

from __future__ import annotations

import argparse

from api_schemas import TeamOut
from trainyard.client_cli import connect, guarded, print_table

DEVICES = ("cpu", "cuda")


def quota_item(text: str) -> tuple[str, int]:
    """`cuda=8`, or `slurm/cuda=8` in a cluster pool: a kind of slots and how many."""
    kind, equals, slots = text.partition("=")
    pool, _, device = kind.rpartition("/")
    if not equals or device not in DEVICES or (pool and not pool.replace("-", "").isalnum()) or not slots.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: give KIND=SLOTS, KIND one of {', '.join(DEVICES)} or POOL/{'|'.join(DEVICES)} (e.g. cuda=8, slurm/cuda=8)"
        )
    return kind, int(slots)


def quota_of(items: list[tuple[str, int]]) -> dict[str, int]:
    """KIND=SLOTS items as a quota; a kind named twice is a mistake, not a last-one-wins."""
    quota = dict(items)
    if len(quota) != len(items):
        raise SystemExit("error: a kind of slots is given more than once")
    return quota


def slots(by_device: dict[str, int]) -> str:
    return ", ".join(f"{n} {device}" for device, n in sorted(by_device.items())) or "-"


def print_teams(teams: list[TeamOut]) -> None:
    print_table(
        ["TEAM", "QUOTA", "IN USE", "BORROWED", "WAITING", "RECENT DEVICE-HOURS", "FAIR SHARE", "MEMBERS (* default)"],
        [[t.name, slots(t.quota), slots(t.in_use), slots(t.borrowed), t.waiting_jobs, f"{t.recent_device_hours:.3f}", f"{t.fair_share:.2f}",
          ", ".join(t.members) or "-"] for t in teams],
    )


def cmd_team_ls(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print_teams(client.teams())
    return 0


def cmd_team_create(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print_teams([client.create_team(args.name, quota_of(args.quota))])
    return 0


def cmd_team_quota(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print_teams([client.set_team_quota(args.name, quota_of(args.quota))])
    return 0


def cmd_team_add(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print_teams([client.add_team_member(args.name, args.user, default=args.default)])
    return 0


def cmd_team_remove(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print_teams([client.remove_team_member(args.name, args.user)])
    return 0


def add_team_commands(subparsers, connection: argparse.ArgumentParser) -> None:
    team = subparsers.add_parser("team", help="teams: quotas of devices, borrowing what is idle, fair share")
    commands = team.add_subparsers(dest="team_command", required=True)
    ls = commands.add_parser("ls", parents=[connection], help="each team's quota, what it holds and borrows now, its fair share")
    ls.set_defaults(func=guarded(cmd_team_ls))
    create = commands.add_parser("create", parents=[connection], help="a new team (admins only)")
    create.add_argument("name")
    create.add_argument("quota", nargs="*", type=quota_item, metavar="KIND=SLOTS", help="its nominal quota, e.g. cuda=8 cpu=16 slurm/cuda=32 (a cluster pool's)")
    create.set_defaults(func=guarded(cmd_team_create))
    quota = commands.add_parser("quota", parents=[connection], help="set a team's quota; a kind left out has none (admins only)")
    quota.add_argument("name")
    quota.add_argument("quota", nargs="*", type=quota_item, metavar="KIND=SLOTS")
    quota.set_defaults(func=guarded(cmd_team_quota))
    add = commands.add_parser("add", parents=[connection], help="add a user to a team (admins only); their first team is their default")
    add.add_argument("name")
    add.add_argument("user")
    add.add_argument("--default", action="store_true", help="make it the team their jobs run under when they name none")
    add.set_defaults(func=guarded(cmd_team_add))
    remove = commands.add_parser("remove", parents=[connection], help="remove a user from a team (admins only)")
    remove.add_argument("name")
    remove.add_argument("user")
    remove.set_defaults(func=guarded(cmd_team_remove))
