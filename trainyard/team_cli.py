"""`trainyard team`: teams, their quotas and members (admins change them), and what each holds now."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from api_schemas import TeamOut
from trainyard.client import Client
from trainyard.client_cli import BadInput, connect, guarded, print_table

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
        raise BadInput("a kind of slots is given more than once")
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


def printing_the_team(change: Callable[[Client, argparse.Namespace], TeamOut]) -> Callable[[argparse.Namespace], int]:
    """A command that changes one team (admins only) and prints it as it is now."""
    def command(args: argparse.Namespace) -> int:
        with connect(args) as client:
            print_teams([change(client, args)])
        return 0
    return guarded(command)


def cmd_team_delete(args: argparse.Namespace) -> int:
    with connect(args) as client:
        client.delete_team(args.name)
    print(f"team {args.name} deleted")
    return 0


def add_team_commands(subparsers, connection: argparse.ArgumentParser) -> None:
    team = subparsers.add_parser("team", help="teams: quotas of devices, borrowing what is idle, fair share")
    commands = team.add_subparsers(dest="team_command", required=True)

    def command(name: str, help: str, *arguments: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, parents=[connection], help=help)
        for argument in arguments:
            sub.add_argument(argument)
        return sub

    command("ls", "each team's quota, what it holds and borrows now, its fair share").set_defaults(func=guarded(cmd_team_ls))
    create = command("create", "a new team (admins only)", "name")
    create.add_argument("quota", nargs="*", type=quota_item, metavar="KIND=SLOTS", help="its nominal quota, e.g. cuda=8 cpu=16 slurm/cuda=32 (a cluster pool's)")
    create.set_defaults(func=printing_the_team(lambda client, args: client.create_team(args.name, quota_of(args.quota))))
    quota = command("quota", "set a team's quota: a kind left out has none, KIND=0 clears one (admins only)", "name")
    quota.add_argument("quota", nargs="+", type=quota_item, metavar="KIND=SLOTS")
    quota.set_defaults(func=printing_the_team(lambda client, args: client.set_team_quota(args.name, quota_of(args.quota))))
    add = command("add", "add a user to a team (admins only); their first team is their default", "name", "user")
    add.add_argument("--default", action="store_true", help="make it the team their jobs run under when they name none")
    add.set_defaults(func=printing_the_team(lambda client, args: client.add_team_member(args.name, args.user, default=args.default)))
    remove = command("remove", "remove a user from a team (admins only)", "name", "user")
    remove.set_defaults(func=printing_the_team(lambda client, args: client.remove_team_member(args.name, args.user)))
    delete = command("delete", "delete a team that no job ever ran under (admins only; else set its quota to 0)", "name")
    delete.set_defaults(func=guarded(cmd_team_delete))
