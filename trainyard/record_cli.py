"""`trainyard record N`, `trainyard rerun N`, `trainyard diff N M`: what a job was (api_schemas/run_record.py),
running it again to the same weights, and where two runs differ."""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

from api_schemas.jobs import WORKER_OWN_PACKAGES
from api_schemas.run_record import RunEnvironment, RunRecord
from trainyard.client import TrainyardError
from trainyard.client_cli import EXIT_INTERRUPTED, connect, guarded, of_job, print_json, print_table, report_outcome
from trainyard.compare_cli import ABSENT, shown, spec_differences
from trainyard.progress import follow_job

MAX_PINNED = 64  # JobSpec's environment.pip holds at most this many requirements
NOT_A_DIFFERENCE = ("name", "inputs_sha256")  # a rerun's own name and the digests it holds are what a rerun is


def rerun_spec(record: RunRecord) -> dict:
    """The job's spec, holding the inputs to the digests it read and its `environment.pip` to the
    versions it resolved to: run on the same kind of device, it trains the same weights bit for bit."""
    environment = record.environment
    if environment is None:
        raise TrainyardError(f"job {record.job_id} has no run record from a worker (it never started): nothing to rerun it from")
    read = {name: digest for attempt in record.attempts if attempt.environment for name, digest in attempt.environment.inputs.items()
            if digest != environment.inputs.get(name, digest)}
    if read and not record.spec.get("inputs_sha256"):
        print(f"note: job {record.job_id}'s attempts read different contents of {', '.join(sorted(read))} (changed while it ran): "
              "the rerun is held to what its last attempt read, and can't reproduce what the earlier ones trained on", file=sys.stderr)
    spec = copy.deepcopy(record.spec)
    # A job that was itself a rerun keeps its own pins: if it failed because an input changed, its
    # record holds the changed digest, and pinning that would train on the changed data.
    spec["inputs_sha256"] = spec.get("inputs_sha256") or environment.inputs or None
    pins = {name: version for name, version in environment.environment_packages.items() if name not in WORKER_OWN_PACKAGES}
    if spec.get("environment") and pins:
        if len(pins) > MAX_PINNED:
            print(f"note: environment.pip kept as written: its {len(pins)} resolved packages are more than a spec pins", file=sys.stderr)
        else:
            spec["environment"]["pip"] = sorted(f"{name}=={version}" for name, version in pins.items())
    return spec


def environment_differences(first: RunEnvironment | None, second: RunEnvironment | None) -> list[tuple[str, Any, Any]]:
    """(what, first's, second's) for each part of two attempts' environments that differs (ABSENT where only one has it)."""
    if first is None or second is None:
        return [] if first is second else [("environment", ABSENT if first is None else "reported", ABSENT if second is None else "reported")]
    rows = [(field, getattr(first, field), getattr(second, field)) for field in ("python", "platform", "device", "cpu_threads")]
    for kind in ("inputs", "packages", "environment_packages"):
        a, b = getattr(first, kind), getattr(second, kind)
        rows += [(f"{kind}.{name}", a.get(name, ABSENT), b.get(name, ABSENT)) for name in sorted(a.keys() | b.keys())]
    return [(what, a, b) for what, a, b in rows if a != b]


def cmd_record(args: argparse.Namespace) -> int:
    with connect(args) as client:
        record = client.record(args.job_id)
    if args.json:
        print(record.model_dump_json(indent=2))
        return 0
    print(f"job {record.job_id} ({record.name})" + (f"; code bundle sha256 {record.code_sha256}" if record.code_sha256 else ""))
    for attempt in record.attempts:
        env = attempt.environment
        where = f"attempt {attempt.attempt}" + (f" node {attempt.node_rank}" if attempt.node_rank else "") + f" on {attempt.host_name}"
        if env is None:
            print(f"{where}: no environment reported")
            continue
        versions = ", ".join(f"{name} {env.packages[name]}" for name in ("torch", "accelerate") if name in env.packages)
        threads = f" ({env.cpu_threads} thread{'s' if env.cpu_threads > 1 else ''} a process)" if env.cpu_threads else ""
        print(f"{where}: {env.device}{threads}; Python {env.python}, {versions}; {env.platform}")
        for name, sha256 in sorted(env.inputs.items()):
            print(f"  input {name}: sha256 {sha256}")
        if env.environment_packages:
            print("  environment: " + ", ".join(f"{n}=={v}" for n, v in sorted(env.environment_packages.items())))
    return 0


def cmd_rerun(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.submit(rerun_spec(client.record(args.job_id)))
        print(f"submitted job {job.id} ({job.name}): a rerun of job {args.job_id}, its inputs held to the digests it read; "
              f"`trainyard diff {args.job_id} {job.id}` shows what differs once it runs")
        if not args.follow:
            return 0
        try:
            return report_outcome(follow_job(client, job.id))
        except KeyboardInterrupt:
            print(f"\nstopped following; job {job.id} keeps running", file=sys.stderr)
            return EXIT_INTERRUPTED


def cmd_diff(args: argparse.Namespace) -> int:
    with connect(args) as client:
        records = [of_job(client.record, job_id) for job_id in (args.first, args.second)]
    titles = [f"JOB {record.job_id}" for record in records]
    rows = [(f"spec.{path}", a, b) for path, a, b in spec_differences(*(r.spec for r in records)) if path.split(".")[0] not in NOT_A_DIFFERENCE]
    if records[0].code_sha256 != records[1].code_sha256:
        rows.append(("code bundle", records[0].code_sha256 or ABSENT, records[1].code_sha256 or ABSENT))
    rows += environment_differences(records[0].environment, records[1].environment)
    if args.json:  # each difference: what, and each job's value as stored (a key left out: that job has none)
        print_json([{"what": what, **{key: value for key, value in (("first", a), ("second", b)) if value is not ABSENT}} for what, a, b in rows])
        return 0
    if not rows:
        print(f"jobs {args.first} and {args.second} ran the same spec on the same inputs, packages and kind of device (and CPU threads)")
        return 0
    print_table(["WHAT", *titles], [(what, shown(a), shown(b)) for what, a, b in rows])
    return 0


def add_record_commands(subparsers, connection: argparse.ArgumentParser) -> None:
    record = subparsers.add_parser("record", help="what a job ran with: inputs' sha256, packages, device", parents=[connection])
    record.add_argument("job_id", type=int)
    record.add_argument("--json", action="store_true", help="the whole record as JSON")
    record.set_defaults(func=guarded(cmd_record))

    rerun = subparsers.add_parser(
        "rerun", help="submit a job again from its run record (its inputs held to their digests, environment.pip pinned)",
        parents=[connection],
    )
    rerun.add_argument("job_id", type=int)
    rerun.add_argument("--follow", action="store_true", help="follow the rerun to its end")
    rerun.set_defaults(func=guarded(cmd_rerun))

    diff = subparsers.add_parser("diff", help="where two jobs' run records differ: spec, code, inputs, packages, device", parents=[connection])
    diff.add_argument("first", type=int, help="a job id")
    diff.add_argument("second", type=int, help="another job id")
    diff.add_argument("--json", action="store_true", help="the differences as a JSON list of {what, first, second}, values as stored (a key left out: that job has none)")
    diff.set_defaults(func=guarded(cmd_diff))
