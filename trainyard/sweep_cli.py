"""`trainyard sweep submit FILE | ls | show ID | cancel ID`: hyperparameter searches from the command line."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

from api_schemas import SweepOut
from trainyard.client_cli import connect, guarded, load_spec_file, local_time, positive, print_table


def cmd_sweep_submit(args: argparse.Namespace) -> int:
    with connect(args) as client:
        sweep = client.submit_sweep(load_spec_file(args.file))
    print(f"sweep {sweep.id} ({sweep.name}) submitted: up to {sweep.spec.budget.max_trials} trials, {sweep.spec.budget.max_concurrent} at a time")
    return 0


def cmd_sweep_ls(args: argparse.Namespace) -> int:
    with connect(args) as client:
        sweeps = list(itertools.islice(client.sweeps(limit=min(args.limit, 200)), args.limit))
    print_table(
        ["ID", "NAME", "STATUS", "TRIALS", "BEST", "CREATED"],
        [[s.id, s.name, s.status.value, f"{len(s.trials)}/{s.spec.budget.max_trials}", best_text(s), local_time(s.created_at)] for s in sweeps],
    )
    return 0


def cmd_sweep_show(args: argparse.Namespace) -> int:
    with connect(args) as client:
        sweep = client.sweep(args.id)
    objective = sweep.spec.objective
    print(f"sweep {sweep.id}: {sweep.name} (owner {sweep.owner}), {sweep.status.value}; {objective.direction} {objective.metric}")
    if sweep.failure_reason:
        print(f"  {sweep.failure_reason}")
    paths = list(sweep.spec.search_space)
    print_table(
        ["TRIAL", "JOB", *paths, "STATUS", "STEP", objective.metric.upper()],
        [
            [t.number, t.job_id, *(t.params.get(path) for path in paths), t.status.value, t.step, "-" if t.value is None else f"{t.value:.4g}"]
            for t in sweep.trials
        ],
    )
    if sweep.best_spec is not None:
        best = next(t for t in sweep.trials if t.number == sweep.best_trial)
        print(f"\nbest: trial {best.number}, {sweep.spec.objective.metric} {best.value:.4g}; its spec, to submit with `trainyard submit FILE`:")
        print(json.dumps(sweep.best_spec, indent=2))
    return 0


def cmd_sweep_cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        sweep = client.cancel_sweep(args.id)
    print(f"sweep {sweep.id}: {sweep.status.value}")
    return 0


def best_text(sweep: SweepOut) -> str:
    if sweep.best_trial is None:
        return "-"
    best = next(t for t in sweep.trials if t.number == sweep.best_trial)
    return f"#{best.number} {best.value:.4g}"


def add_sweep_commands(subparsers, connection: argparse.ArgumentParser) -> None:
    sweep = subparsers.add_parser("sweep", help="hyperparameter searches: submit, ls, show, cancel")
    commands = sweep.add_subparsers(dest="sweep_command", required=True)

    def command(name: str, handler: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help, parents=[connection])
        parser.set_defaults(func=guarded(handler))
        return parser

    command("submit", cmd_sweep_submit, "submit a sweep spec (YAML or JSON): base job spec, search space, sampler, objective, budget, pruner").add_argument("file")
    command("ls", cmd_sweep_ls, "list sweeps, newest first").add_argument("--limit", type=positive, default=50)
    command("show", cmd_sweep_show, "a sweep's trials and its best trial's spec, ready to submit").add_argument("id", type=int)
    command("cancel", cmd_sweep_cancel, "cancel a sweep and its unfinished trials").add_argument("id", type=int)
