"""`trainyard compare A B`: two jobs side by side, the spec fields that differ and their final metrics."""

from __future__ import annotations

import argparse
import json
from typing import Any

from trainyard.client_cli import connect, guarded, of_job, print_table


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A spec as dotted paths to its leaves: {"optimizer.lr": 0.001, …} (lists are leaves)."""
    if isinstance(tree, dict) and tree:
        return {path: leaf for key, value in tree.items() for path, leaf in flatten(value, f"{prefix}.{key}" if prefix else key).items()}
    return {prefix: tree}


ABSENT = object()  # a field, package or input only the other job has: `-` in a table, left out of JSON


def spec_differences(first: dict, second: dict) -> list[tuple[str, Any, Any]]:
    """(path, first's value, second's) for each field that differs; ABSENT where only the other has it."""
    a, b = (flatten(spec) for spec in (first, second))
    return [(path, a.get(path, ABSENT), b.get(path, ABSENT)) for path in sorted(a.keys() | b.keys())
            if a.get(path, ABSENT) != b.get(path, ABSENT)]


def final_values(series: dict) -> dict[str, float | None]:
    """Each metric's value at its last step."""
    return {name: points.values[-1] for name, points in series.items() if points.values}


def shown(value: Any) -> str:
    """A spec's value as written (every digit: two learning rates may differ past the fourth)."""
    if value is ABSENT:
        return "-"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def shown_metric(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def cmd_compare(args: argparse.Namespace) -> int:
    with connect(args) as client:
        jobs = [of_job(client.job, job_id) for job_id in (args.first, args.second)]
        finals = [final_values(client.metrics(job.id, max_points=16).series) for job in jobs]
    titles = [f"JOB {job.id} ({job.name})" for job in jobs]
    print(f"job {jobs[0].id}: {jobs[0].status.value} at step {jobs[0].step}; job {jobs[1].id}: {jobs[1].status.value} at step {jobs[1].step}")
    differences = spec_differences(*(job.spec.model_dump(mode="json") for job in jobs))
    if differences:
        print_table(["SPEC FIELD", *titles], [[path, shown(a), shown(b)] for path, a, b in differences])
    else:
        print("the specs are the same")
    print()
    names = sorted(name for name in finals[0].keys() | finals[1].keys() if not name.startswith("sys/"))  # results, not the machine's samples
    print_table(["FINAL METRIC", *titles], [[name, *(shown_metric(final.get(name)) for final in finals)] for name in names])
    return 0


def add_compare_command(subparsers, connection: argparse.ArgumentParser) -> None:
    compare = subparsers.add_parser(
        "compare", help="two jobs side by side: spec fields that differ, final metrics", parents=[connection]
    )
    compare.add_argument("first", type=int, help="a job id")
    compare.add_argument("second", type=int, help="another job id")
    compare.set_defaults(func=guarded(cmd_compare))
