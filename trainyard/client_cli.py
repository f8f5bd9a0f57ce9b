"""Client commands of `trainyard`: submit, datasets, ls, status, logs, cancel, checkpoints, download, outputs, dashboard, workers.

Each one talks to the server through `Client`; failures print `error: <reason>` and return
1 (2 for input the server or this command refused), never a traceback.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar
from datetime import datetime, timezone
from pathlib import Path

import yaml
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from api_schemas import JobOut, JobStatus
from trainyard.client import Client, TrainyardError
from trainyard.progress import follow_job, steps_text

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class BadInput(TrainyardError):
    """What the user typed can't be used: exits 2, as argparse's own refusals do."""


class SpecFileError(BadInput):
    pass


def positive(text: str) -> int:
    """argparse's type for a count (`--limit`): a whole number, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


def load_spec_file(path: Path) -> dict:
    """A job spec from a .json file, or YAML for any other name."""
    path = Path(path)
    is_json = path.suffix.lower() == ".json"
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecFileError(f"cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:  # a checkpoint or weights file given by mistake, say
        raise SpecFileError(f"{path} is not a text file (byte {exc.start} is not UTF-8): a spec is a JSON or YAML file") from exc
    try:
        spec = json.loads(text) if is_json else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:  # both parsers' messages name the line and column
        raise SpecFileError(f"{path} is not valid {'JSON' if is_json else 'YAML'}: {exc}") from exc
    if spec is None:
        raise SpecFileError(f"{path} is empty: expected a mapping of spec fields")
    if not isinstance(spec, dict):
        raise SpecFileError(f"{path}: expected a mapping of spec fields at the top level, got {type(spec).__name__}")
    return spec


# -- output helpers ------------------------------------------------------------------------------

def print_json(value: object) -> None:
    """What a command shows, as JSON for scripts (`--json`): the API's own fields, one document."""
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def print_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """A table drawn by rich: ruled under a bold header on a terminal; in a pipe or a file, plain
    columns two spaces apart with no colour, no wrapping and no trailing blanks, for scripts to read."""
    interactive = sys.stdout.isatty()
    table = Table(box=box.SIMPLE_HEAD if interactive else None, show_edge=False, pad_edge=False, header_style="bold" if interactive else "")
    for header in headers:
        table.add_column(header)
    for row in rows:
        table.add_row(*(Text(str(cell)) for cell in row))  # Text: a `[` in a job's name is no markup
    if interactive:
        Console().print(table)
        return
    console = Console(width=100_000, no_color=True, highlight=False)
    with console.capture() as captured:
        console.print(table)
    for line in captured.get().splitlines():
        print(line.rstrip())


def local_time(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)  # the server stores UTC
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def human_bytes(size: float) -> str:
    if size < 1024:
        return f"{size:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024:
            break
    return f"{size:.1f} {unit}"


def report_outcome(job: JobOut) -> int:
    """Exit status for a finished job; the reason goes to stderr when it did not succeed."""
    if job.status == JobStatus.succeeded:
        print(f"job {job.id} succeeded at step {steps_text(job.step, job.max_steps)}")
        return 0
    reason = f": {job.failure_reason}" if job.failure_reason else ""
    print(f"job {job.id} {job.status.value}{reason}", file=sys.stderr)
    return EXIT_FAILED


def connect(args: argparse.Namespace) -> Client:
    return Client(server=args.server, token=args.token)


T = TypeVar("T")


def of_job(get: Callable[[int], T], job_id: int) -> T:
    """`get(job_id)`, a 404 saying which job: a command given two ids (`diff`, `compare`) names the missing one."""
    try:
        return get(job_id)
    except TrainyardError as exc:
        if exc.status_code == 404:
            raise TrainyardError(f"job {job_id} not found (no such job, or not yours)", 404) from None
        raise


# -- commands ------------------------------------------------------------------------------------

def cmd_submit(args: argparse.Namespace) -> int:
    with connect(args) as client:
        if args.script is not None:
            job = submit_script(client, args)
        elif args.file is None:
            raise SpecFileError("give a job spec file, or --script FILE [-- ARGS…]")
        elif args.script_args:  # words after a spec file: arguments only a script takes
            raise SpecFileError(f"a spec file takes no more arguments ({' '.join(args.script_args)}): "
                                "change the spec (`trainyard spec ID` prints one), or give --script FILE -- ARGS…")
        else:
            job = client.submit(load_spec_file(Path(args.file)))
        print(f"submitted job {job.id} ({job.name}): {job.status.value}")
        if not args.follow:
            return 0
        try:
            job = follow_job(client, job.id)
        except KeyboardInterrupt:
            print(f"\nstopped following; job {job.id} keeps running (`trainyard cancel {job.id}` stops it)", file=sys.stderr)
            return EXIT_INTERRUPTED
        return report_outcome(job)


def submit_script(client: Client, args: argparse.Namespace) -> JobOut:
    """`trainyard submit --script train.py -- --lr 3e-4`: bundle, upload, submit."""
    script = Path(args.script)
    if not script.is_file():
        raise SpecFileError(f"no script {script}")
    # After `--` argparse hands every word to the positionals, the first one to `file`; a `file`
    # given before `--` (or with none) is a spec file, which a script job has no use for.
    typed = args.argv  # as typed (trainyard.cli.main sets it)
    after_dashes = typed[typed.index("--") + 1:] if "--" in typed else []
    if args.file is not None and after_dashes[:1] != [args.file]:
        raise SpecFileError(f"a spec file ({args.file}) and --script are two ways to submit: give one (the script's own arguments go after `--`)")
    script_args = ([args.file] if args.file is not None else []) + args.script_args
    spec = {
        "training": {"precision": args.precision, "gradient_accumulation_steps": args.gradient_accumulation_steps},
        "resources": {"nodes": args.nodes, "processes_per_node": args.processes, "device": args.device, **({"pool": args.pool} if args.pool else {})},
        "max_restarts": args.max_restarts,
        "script_resume_args": shlex.split(args.resume_args) if args.resume_args else [],
        "script_outputs": args.outputs,
    }
    if args.name:
        spec["name"] = args.name
    code_dir, left_out = None if args.file_only else script.resolve().parent, []
    job = client.submit_script(script, script_args, code_dir=code_dir, left_out=left_out, **spec)
    if left_out:  # the job may look for them: say so now, not in its traceback
        print(f"not sent with the script (hidden, or a link to a directory): {', '.join(left_out)}", file=sys.stderr)
    return job


def cmd_datasets_upload(args: argparse.Namespace) -> int:
    with connect(args) as client:
        dataset = client.upload_dataset(Path(args.path), args.name)
    print(f"uploaded dataset {dataset.id} ({dataset.name}, {human_bytes(dataset.size_bytes)}, sha256 {dataset.sha256})")
    print(f'use it in a job spec as "dataset": {{"kind": …, "upload_id": {dataset.id}}}')
    return 0


def cmd_datasets_ls(args: argparse.Namespace) -> int:
    with connect(args) as client:
        rows = [[d.id, d.name, human_bytes(d.size_bytes), d.sha256[:12], local_time(d.created_at)] for d in client.datasets()]
    print_table(["ID", "NAME", "SIZE", "SHA256", "UPLOADED"], rows)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with connect(args) as client:
        # The newest `limit` jobs: one page when it fits in the server's page size (200 at most).
        jobs = list(itertools.islice(client.jobs(status=args.status, limit=min(args.limit, 200)), args.limit))
    if args.json:
        print_json([job.model_dump(mode="json") for job in jobs])
        return 0
    print_table(
        ["ID", "NAME", "STATUS", "STEP", "OWNER", "CREATED"],
        [[j.id, j.name, j.status.value, steps_text(j.step, j.max_steps), j.owner, local_time(j.created_at)] for j in jobs],
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.job(args.id)
    if args.json:
        print_json(job.model_dump(mode="json"))
        return 0
    team = f", team {job.spec.team}" if job.spec.team else ""
    print(f"job {job.id}: {job.name} (owner {job.owner}{team}, priority {job.priority})")
    print(f"  status    {job.status.value}")
    rolled = f", rollbacks {job.rollbacks}" if job.rollbacks else ""
    print(f"  progress  {steps_text(job.step, job.max_steps)} steps, batch {job.effective_batch_size or '-'}, restarts {job.restarts}{rolled}")
    print(f"  created   {local_time(job.created_at)}  started {local_time(job.started_at)}  finished {local_time(job.finished_at)}")
    for mark in job.rollback_marks:  # the loss guard's (training.guard)
        print(f"  rollback  steps {mark.first_step}-{mark.last_step} spiked; went on from step {mark.resume_step} past their batches: {mark.reason}")
    if job.waiting_reason:
        print("  waiting   " + job.waiting_reason)
    if job.failure_reason:
        print("  reason    " + job.failure_reason.replace("\n", "\n" + " " * 12))  # keeps a multi-line reason indented
    if job.attempts:
        # A cluster pool's attempts say which cluster job runs them and what the cluster says of it.
        pooled = any(a.pool for a in job.attempts)
        # A multi-node job's attempt is one row per node: which node each is.
        nodes = any(a.node_rank for a in job.attempts)
        # Why an attempt ended other than succeeded (lost with its host, killed for memory): once the job
        # succeeds its own reason is gone, and this was said only by --json.
        reasons = any(a.failure_reason for a in job.attempts)
        print()
        print_table(
            ["ATTEMPT", *(["NODE"] if nodes else []), "HOST", "PROCESSES", "STATUS", *(["CLUSTER"] if pooled else []), "RESUMED FROM", "STARTED", "FINISHED",
             *(["REASON"] if reasons else [])],
            [
                [a.number, *([a.node_rank] if nodes else []), a.host_name, a.processes, a.status.value, *([cluster_text(a)] if pooled else []),
                 "-" if a.resumed_from_step is None else f"step {a.resumed_from_step}", local_time(a.started_at), local_time(a.finished_at),
                 *([shortened(a.failure_reason or "-", 80)] if reasons else [])]
                for a in job.attempts
            ],
        )
    return 0


def shortened(text: str, most: int) -> str:
    """Its first line, cut to `most` characters (…) for a table's cell."""
    line = text.split("\n", 1)[0]
    if len(line) > most:
        return line[: most - 1] + "…"
    return line if line == text else line + "…"  # more lines: said to be there


def cluster_text(attempt) -> str:
    """`slurm job 812: PENDING (Resources)`: the pool, its job id and state, as far as known."""
    if not attempt.pool:
        return "-"
    job_id = f" job {attempt.cluster_job_id}" if attempt.cluster_job_id else ""
    return f"{attempt.pool}{job_id}: {attempt.cluster_state}" if attempt.cluster_state else attempt.pool + job_id


def cmd_logs(args: argparse.Namespace) -> int:
    with connect(args) as client:
        # Several processes' lines interleave: each says whose it is (`[rank 1] …`), as the API tags them.
        tagged = args.rank is None and client.job(args.id).spec.resources.slots > 1
        if args.follow:
            lines = client.follow_logs(args.id, tail=args.tail, rank=args.rank)
        else:
            lines = client.logs(args.id, tail=args.tail, rank=args.rank).lines
        attempt = None
        for line in lines:
            if line.attempt != attempt:
                attempt = line.attempt
                print(f"--- attempt {attempt} ---")
            print(f"[rank {line.rank}] {line.line}" if tagged and line.rank is not None else line.line, flush=True)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.cancel(args.id)
    if job.status == JobStatus.cancelled:
        print(f"job {job.id} is cancelled")
    elif job.status.is_final:
        print(f"job {job.id} had already ended ({job.status.value}): nothing to cancel")
    else:
        cluster_job = next((a.cluster_job_id for a in reversed(job.attempts) if a.cluster_job_id), None)
        stops = f"Slurm ends its job {cluster_job}" if cluster_job else "its worker stops it"
        print(f"cancel requested; job {job.id} is {job.status.value} until {stops}")
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    with connect(args) as client:
        checkpoints = client.checkpoints(args.id)
        if args.json:
            print_json([c.model_dump(mode="json") for c in checkpoints])
            return 0
        if not checkpoints:
            job = client.job(args.id)
            why = "yet" if not job.status.is_final else f"(it ended {job.status.value} without one)"
            print(f"job {args.id} has no checkpoints {why}")
            return 0
        # A job keeping its best by another metric than eval_loss (checkpoint.best_metric): that metric's column too.
        ranked_by = client.job(args.id).spec.checkpoint.best_metric if any(c.best for c in checkpoints) else "eval_loss"
    ranked = [] if ranked_by == "eval_loss" else [ranked_by.upper()]
    print_table(
        ["ID", "STEP", "EVAL_LOSS", *ranked, "BEST", "SIZE", "SHA256", "CREATED"],
        [
            [c.id, c.step, "-" if c.eval_loss is None else f"{c.eval_loss:.4f}", *(["-" if c.best_value is None else f"{c.best_value:.4g}"] if ranked else []),
             "best" if c.best else "", human_bytes(c.size_bytes), c.sha256[:16], local_time(c.created_at)]
            for c in checkpoints
        ],
    )
    return 0


def cmd_spec(args: argparse.Namespace) -> int:
    """The job's spec as stored, as YAML (or JSON): what to edit and submit again."""
    with connect(args) as client:
        spec = client.job(args.id).spec.model_dump(mode="json", exclude_none=True)
    if args.json:
        print_json(spec)
    else:
        sys.stdout.write(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))  # "héllo", not "h\xE9llo"
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    if args.state:
        if args.output and Path(args.output).suffix in (".tar", ".gz", ".tgz", ".zip", ".safetensors"):
            print(f"error: --state unpacks the checkpoint's folder, verified, into a directory: -o names that directory, "
                  f"and {args.output!r} looks like a file's name", file=sys.stderr)
            return EXIT_BAD_INPUT
        with connect(args) as client:
            directory = client.download_state(args.checkpoint_id, Path(args.output or "."))
        print(f"saved {directory}/ (every file verified against its manifest)")
        return 0
    dest = Path(args.output or f"checkpoint-{args.checkpoint_id}.safetensors")
    with connect(args) as client:
        path = download_with_progress(client, args.checkpoint_id, dest)
    print(f"saved {path} (sha256 verified)")
    return 0


def cmd_outputs(args: argparse.Namespace) -> int:
    dest = Path(args.output)
    with connect(args) as client:
        outputs = client.outputs(args.id)
        names = args.names or [output.name for output in outputs]
        if not names:
            raise TrainyardError(f"job {args.id} has no collected outputs (a script job's `script.outputs` names the directories collected)")
        if missing := sorted(set(names) - {output.name for output in outputs}):
            raise TrainyardError(f"job {args.id} has no collected output {', '.join(missing)}" if outputs else f"job {args.id} has no collected outputs")
        files = {output.name: output.files for output in outputs}
        for name in names:
            directory = client.download_output(args.id, name, dest)
            if files[name]:
                print(f"saved {directory}/ (every file verified against its manifest)")
            else:  # said, not an empty folder called "verified"
                print(f"saved {directory}/: empty, as collected (its folders that were the script's `save_state` checkpoints are "
                      f"listed apart: `trainyard checkpoints {args.id}`)")
    return 0


def download_with_progress(client: Client, checkpoint_id: int, dest: Path) -> Path:
    """`client.download`, with the bytes so far shown on one redrawn line when stderr is a terminal."""
    if not sys.stderr.isatty():
        return client.download(checkpoint_id, dest)

    def show(done: int, total: int | None) -> None:
        of_total = f" of {human_bytes(total)}" if total else ""
        sys.stderr.write(f"\rdownloading {human_bytes(done)}{of_total}   ")
        sys.stderr.flush()

    try:
        return client.download(checkpoint_id, dest, progress=show)
    finally:
        sys.stderr.write("\n")


def cmd_dashboard(args: argparse.Namespace) -> int:
    with connect(args) as client:
        dashboard = client.dashboard()
    if dashboard.scheduler_down:
        print(f"warning: {dashboard.scheduler_down}", file=sys.stderr)
    print("jobs: " + ", ".join(f"{count} {status}" for status, count in dashboard.jobs_by_status.items()))
    if dashboard.running:
        print()
        print_table(
            ["ID", "NAME", "OWNER", "PROGRESS", "LOSS", "HOST"],
            [
                [r.id, r.name, r.owner, steps_text(r.step, r.max_steps) + (f" ({r.progress:.0%})" if r.progress is not None else ""),
                 "-" if r.last_train_loss is None else f"{r.last_train_loss:.4f}", r.host_name or "-"]
                for r in dashboard.running
            ],
        )
    print()
    print_workers(dashboard.workers)
    return 0


def cmd_workers(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print_workers(client.workers())
    return 0


def print_workers(workers) -> None:
    print_table(
        ["WORKER", "DEVICE", "BUSY/SLOTS", "ONLINE", "LAST HEARTBEAT"],
        [[w.name, w.device, f"{w.busy_slots}/{w.slots}", "yes" if w.online else "no", local_time(w.last_heartbeat)] for w in workers],
    )


# -- registration --------------------------------------------------------------------------------

def guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """The handler, with errors printed as `error: <message>` instead of a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except TrainyardError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT if isinstance(exc, BadInput) or exc.status_code == 422 else EXIT_FAILED
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED

    return run


def add_connection_options(parser: argparse.ArgumentParser, default=None) -> None:
    parser.add_argument(
        "--server", default=default, help="API URL (default: $TRAINYARD_SERVER, the config file's server:, or http://127.0.0.1:8000)"
    )
    parser.add_argument(
        "--token", default=default,
        help="bearer token (default: $TRAINYARD_TOKEN, the config file's token:, or the token file of `trainyard up`)",
    )


def add_client_commands(subparsers) -> argparse.ArgumentParser:
    """The client's commands; returns the parser of the connection options they all take."""
    # Every client command takes the connection options, so they work after the command name as
    # before it (`trainyard --token X ls`): unset here they keep what the top level read.
    connection = argparse.ArgumentParser(add_help=False)
    add_connection_options(connection, default=argparse.SUPPRESS)

    def command(name: str, handler: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(name, help=help, parents=[connection])
        parser.set_defaults(func=guarded(handler))
        return parser

    submit = command("submit", cmd_submit, "submit a job spec (YAML or JSON), or your own Accelerate script with --script")
    submit.add_argument("file", nargs="?", help="job spec file")
    submit.add_argument("script_args", nargs="*", help="with --script: the script's arguments, after `--`")
    submit.add_argument("--follow", action="store_true", help="show progress until the job ends; exit 1 unless it succeeded")
    script = submit.add_argument_group("--script: run an unchanged `accelerate launch` script (needs the can_run_code permission)")
    script.add_argument("--script", help="the script; its directory is uploaded with it (see --file-only)")
    script.add_argument("--file-only", action="store_true", help="upload only the script, not its directory")
    script.add_argument("--name", help="job name (default: the script's name)")
    script.add_argument("--processes", type=int, default=1, help="processes (devices) per node (default 1)")
    script.add_argument("--nodes", type=int, default=1, help="hosts (default 1)")
    script.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    script.add_argument("--pool", help="a cluster pool to run it in (GET /v1/pools; e.g. slurm), not the service's own hosts")
    script.add_argument("--precision", choices=["no", "fp16", "bf16"], default="no")
    script.add_argument("--gradient-accumulation-steps", type=int, default=1)
    script.add_argument("--max-restarts", type=int, default=3)
    script.add_argument(
        "--resume-args", help="added to the arguments when an attempt resumes, e.g. '--resume_from_checkpoint {checkpoint}'"
    )
    script.add_argument(
        "--outputs", action="append", default=[], metavar="DIR",
        help="a directory the script writes (relative to its directory), collected when the job succeeds: `trainyard outputs ID` "
        "fetches it (repeat for more)",
    )

    datasets = subparsers.add_parser("datasets", help="upload and list datasets")
    datasets_commands = datasets.add_subparsers(dest="datasets_command", required=True)
    upload = datasets_commands.add_parser("upload", help="upload a data file", parents=[connection])
    upload.add_argument("path", help="the file")
    upload.add_argument("--name", help="name to show (default: the file's)")
    upload.set_defaults(func=guarded(cmd_datasets_upload))
    datasets_commands.add_parser("ls", help="your uploaded datasets", parents=[connection]).set_defaults(func=guarded(cmd_datasets_ls))

    ls = command("ls", cmd_ls, "list jobs, newest first")
    ls.add_argument("--status", choices=[s.value for s in JobStatus])
    ls.add_argument("--limit", type=positive, default=50, help="show at most this many (default 50)")
    ls.add_argument("--json", action="store_true", help="the jobs as a JSON list, as the API gives them (for scripts)")

    status = command("status", cmd_status, "show a job and its attempts")
    status.add_argument("id", type=int)
    status.add_argument("--json", action="store_true", help="the job as JSON, as the API gives it (for scripts)")

    logs = command("logs", cmd_logs, "print a job's latest log lines")
    logs.add_argument("id", type=int)
    logs.add_argument("--tail", type=int, default=100, help="lines to show (default 100)")
    logs.add_argument("-f", "--follow", action="store_true", help="then print new lines as they come, until the job ends")
    logs.add_argument("--rank", type=int, help="only what this process (global rank) printed")

    command("cancel", cmd_cancel, "cancel a job").add_argument("id", type=int)
    checkpoints = command("checkpoints", cmd_checkpoints, "list a job's checkpoints")
    checkpoints.add_argument("id", type=int)
    checkpoints.add_argument("--json", action="store_true", help="the checkpoints as a JSON list, as the API gives them (for scripts)")

    spec = command("spec", cmd_spec, "print a job's spec, to edit and submit again")
    spec.add_argument("id", type=int)
    spec.add_argument("--json", action="store_true", help="JSON instead of YAML")

    download = command("download", cmd_download, "download a checkpoint's model.safetensors, verified by sha256")
    download.add_argument("checkpoint_id", type=int)
    download.add_argument("-o", "--output", help="file to write (default checkpoint-<ID>.safetensors); with --state, the directory to unpack into (default .)")
    download.add_argument(
        "--state", action="store_true", help="the whole checkpoint (Accelerate state, weights, manifest) to resume from, not only the weights"
    )

    outputs = command("outputs", cmd_outputs, "download the directories a script job wrote (its script.outputs), verified")
    outputs.add_argument("id", type=int)
    outputs.add_argument("names", nargs="*", help="which (default: all collected)")
    outputs.add_argument("-o", "--output", default=".", help="the directory to unpack them into, each under its name (default .)")

    command("dashboard", cmd_dashboard, "jobs by status, running jobs and workers")
    command("workers", cmd_workers, "list worker hosts")
    return connection
