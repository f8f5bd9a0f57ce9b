"""Runs one attempt of a job on this host, from claim to final status.

The Celery message only says "run attempt X". The supervisor claims X in the database with a
lease (a duplicate delivery finds it claimed and does nothing), launches the training processes
with Accelerate's launcher, and while they run: renews the lease, stops them on cancel, kills them
when they stop making steps (`training.stall_timeout_s`), and forwards what the training loop
wrote (metrics and checkpoint events in a JSONL file, stdout and stderr) to the database and
artifact store. The events file is the worker-side buffer: if the database is briefly
unreachable, nothing is lost, it is delivered on the next successful flush.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_for
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import sessionmaker

from api_schemas import AttemptStatus, JobSpec
from api_schemas.manifest import CorruptCheckpoint
from api_schemas.requirements import unmet
from api_schemas.worker_protocol import CHECKPOINT_DIR_ENV, EVENTS_FILE_ENV, EXIT_PREEMPTED, RESUME_FROM_ENV
from service.artifacts import ArtifactStore
from service.db.attempts import ClaimedAttempt, Lease, claim_attempt, finish_attempt, gang_rendezvous, renew_lease
from service.db.checkpoints import record_checkpoint
from service.db.log_lines import record_logs
from service.db.metrics import record_metrics
from service.settings import Settings
from service.uploads import UploadRefused, code_directory

log = logging.getLogger("trainyard.worker")

MAX_LOG_LINE = 4000
REASON_LOG_LINES = 20
# How long a sync waits for a checkpoint being taken into the store before it renews the lease
# anyway (a move takes milliseconds; a copy to another filesystem, and its hash, can take minutes).
INGEST_WAIT_SECONDS = 1.0
# In an attempt's directory: what the training loop reports (metrics, checkpoints), as JSON lines.
EVENTS_FILE_NAME = "events.jsonl"


def launch_command(
    spec: JobSpec, run_dir: Path, data_root: Path, resume_from: Path | None, rendezvous: str, node_rank: int = 0,
    plugin_dir: Path | None = None,
) -> list[str]:
    """`accelerate launch -m workers.training …` with the job's process counts and precision, for
    node `node_rank` of the job; `rendezvous` is host:port of node 0, where the processes meet.
    A `script` job runs `accelerate launch <entrypoint> <args>` instead (in its code directory)."""
    command = _accelerate_launch(spec, run_dir, rendezvous, node_rank)
    if spec.script is not None:
        args = list(spec.script.args)
        if resume_from is not None:
            args += [arg.replace("{checkpoint}", str(resume_from)) for arg in spec.script.resume_args]
        return command + [spec.script.entrypoint, *args]
    command += ["-m", "workers.training", "--spec", str(run_dir / "spec.json"), "--data-root", str(data_root), "--run-dir", str(run_dir)]
    if resume_from is not None:
        command += ["--resume-from", str(resume_from)]
    if plugin_dir is not None:
        command += ["--plugin-dir", str(plugin_dir)]
    return command


# What a script job's processes inherit from the worker's environment: nothing else, so no service
# credential (database or broker URL, tokens) reaches user code.
SCRIPT_INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
SCRIPT_SITE = Path(__file__).resolve().parent / "script_site"  # its sitecustomize.py installs workers/script_hooks.py


# The service's own credentials: no training process needs them (it reports through files).
SERVICE_CREDENTIALS = ("TRAINYARD_DATABASE_URL", "TRAINYARD_BROKER_URL")


def training_environment(spec: JobSpec, run_dir: Path, resume_from: Path | None) -> dict[str, str]:
    """The environment of an attempt's processes: a script's clean one, else the worker's own
    without the service's credentials."""
    if spec.script is not None:
        return script_environment(spec, run_dir, resume_from)
    env = {name: value for name, value in os.environ.items() if name not in SERVICE_CREDENTIALS}
    return {**env, EVENTS_FILE_ENV: str(run_dir / EVENTS_FILE_NAME), "PYTHONUNBUFFERED": "1"}


def script_environment(spec: JobSpec, run_dir: Path, resume_from: Path | None) -> dict[str, str]:
    """The whole environment of a script job's processes (the launcher's own additions aside)."""
    env = {name: os.environ[name] for name in SCRIPT_INHERITED_ENV if name in os.environ}
    env.update({
        "PYTHONPATH": str(SCRIPT_SITE),
        "PYTHONUNBUFFERED": "1",
        EVENTS_FILE_ENV: str(run_dir / EVENTS_FILE_NAME),
        CHECKPOINT_DIR_ENV: str(run_dir / "checkpoints"),
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(spec.training.gradient_accumulation_steps),
    })
    if spec.resources.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"  # several processes on CPU meet over gloo (`--cpu` would run just one)
    if resume_from is not None:
        env[RESUME_FROM_ENV] = str(resume_from)
    return env


def _accelerate_launch(spec: JobSpec, run_dir: Path, rendezvous: str, node_rank: int) -> list[str]:
    resources = spec.resources
    address, _, port = rendezvous.rpartition(":")
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--num_processes", str(spec.world_size),
        "--num_machines", str(resources.nodes),
        "--machine_rank", str(node_rank),
        "--main_process_ip", address,
        "--main_process_port", port,
        "--mixed_precision", spec.training.precision,
        "--dynamo_backend", "no",
    ]
    if resources.device == "cpu":
        # Accelerate's own default thread count, passed explicitly so the launcher doesn't warn.
        threads = max(1, (os.cpu_count() or 1) // resources.processes_per_node)
        command += ["--num_cpu_threads_per_process", str(threads)]
    if spec.world_size > 1:
        # torchrun prefixes each process's output with `[default<local rank>]:` (see split_rank).
        command += ["--tee", "3", "--log_dir", str(run_dir / "rank-logs")]
        # "One process per device, torchrun-style": gloo on CPU (the loop's Accelerator(cpu=True)
        # picks it), NCCL on GPUs. Accelerate's --cpu flag would run a single process instead.
        command.append("--multi_gpu")
    elif resources.device == "cpu":
        command.append("--cpu")
    return command


def attempt_dir(work_root: Path, job_id: int, number: int, node_rank: int | None = None) -> Path:
    """Where an attempt runs: its events file, checkpoints and a script's copy of its code.
    `node_rank` only for a multi-node job, whose nodes share the attempt's number."""
    node = "" if node_rank is None else f"-node-{node_rank}"
    return work_root / f"job-{job_id}" / f"attempt-{number}{node}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # free on every interface: other hosts of a gang connect to it
        return s.getsockname()[1]


class EventTail:
    """Reads the complete lines appended to the training loop's events file since the last read."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a half-written last line waits for the next read
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


@dataclass
class Outbox:
    """What the attempt produced that the database has not stored yet."""

    metrics: list[tuple[int, str, float]] = field(default_factory=list)
    logs: list[tuple[int, str]] = field(default_factory=list)
    checkpoints: list[tuple[int, Path]] = field(default_factory=list)
    ingesting: Future | None = None  # the first of `checkpoints`, being taken into the store
    recent_logs: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.metrics or self.logs or self.checkpoints)


class StallWatch:
    """Time since the training loop last reported an optimizer step (or, before the first, since the start)."""

    def __init__(self, timeout_seconds: float | None):
        self.timeout_seconds = timeout_seconds
        self.last_progress = time.monotonic()

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    def expired(self) -> bool:
        return self.timeout_seconds is not None and time.monotonic() - self.last_progress > self.timeout_seconds

    @property
    def reason(self) -> str:
        return f"stalled: no optimizer step for {self.timeout_seconds:g} s; its processes were killed"


class AttemptRunner:
    def __init__(self, settings: Settings, sessions: sessionmaker, host_name: str, address: str = "127.0.0.1"):
        self.settings, self.sessions, self.host_name, self.address = settings, sessions, host_name, address
        self.store = ArtifactStore(settings.resolved_artifact_root)
        # Checkpoints are taken into the store off the supervising thread: one copied to another
        # filesystem and hashed can take longer than a lease lasts, and must not keep it from renewal.
        self.ingest = ThreadPoolExecutor(max_workers=4, thread_name_prefix="checkpoint-ingest")
        self.shutting_down = threading.Event()

    @property
    def node_0_wait_seconds(self) -> float:
        """How long the other nodes of a gang wait for node 0 to start: past the dispatch timeout,
        after which the scheduler re-sends a dispatch nobody claimed, so that one lost message to
        node 0's host is made good by the re-send, not by failing the whole gang (and a restart)."""
        return 2 * self.settings.dispatch_timeout_seconds

    def preempt_all(self) -> None:
        """The host is going away (SIGTERM, spot notice): every running attempt checkpoints and stops."""
        self.shutting_down.set()

    def run(self, attempt_id: int) -> None:
        lease_owner = f"{self.host_name}:{os.getpid()}:{time.time_ns()}"
        with self.sessions() as session:
            rendezvous = f"{self.address}:{free_port()}"  # used if we are node 0
            claimed = claim_attempt(session, attempt_id, lease_owner, self.settings.lease_seconds, rendezvous)
        if claimed is None:
            log.info("attempt %s is not ours to run (already claimed, ended or cancelled)", attempt_id)
            return
        log.info("running job %s attempt %s (resume from step %s)", claimed.job_id, claimed.number, claimed.resume_step)
        outcome, reason = self._supervise(claimed)
        self._finish(claimed, outcome, reason)

    # -- the attempt's life ----------------------------------------------------------------------

    def _supervise(self, claimed: ClaimedAttempt) -> tuple[AttemptStatus | None, str | None]:
        spec = JobSpec.model_validate(claimed.spec)
        node_rank = claimed.node_rank if spec.resources.nodes > 1 else None
        run_dir = attempt_dir(self.settings.resolved_work_root, claimed.job_id, claimed.number, node_rank)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "spec.json").write_text(json.dumps(claimed.spec))
        resume_from = self.store.path(claimed.resume_checkpoint_path) if claimed.resume_checkpoint_path else None
        rendezvous = self._wait_for_node_0(claimed)
        if rendezvous is None:
            return AttemptStatus.failed, f"node 0 of this job did not start within {self.node_0_wait_seconds:.0f} s"
        command = launch_command(
            spec, run_dir, self.settings.resolved_data_root, resume_from, rendezvous, claimed.node_rank, self.settings.resolved_plugin_dir
        )
        cwd = run_dir
        if spec.script is not None:
            # The script runs in a copy of its code: what it writes there stays with this attempt.
            cwd = run_dir / "code"
            shutil.rmtree(cwd, ignore_errors=True)
            try:
                shutil.copytree(code_directory(self.settings, spec.script.code), cwd, symlinks=True)
            except (UploadRefused, OSError) as exc:  # e.g. a code root that differs on this host
                return AttemptStatus.failed, f"cannot get the script's code on {self.host_name}: {exc}"
            if problems := unmet(spec.script.requirements):
                return AttemptStatus.failed, f"host {self.host_name} does not meet script.requirements: {'; '.join(problems)}"
        env = training_environment(spec, run_dir, resume_from)
        if claimed.device_ids:
            # Only the GPUs reserved for this attempt: another job on this host has the others.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, claimed.device_ids))

        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        lines: queue.Queue[str | None] = queue.Queue()
        output = threading.Event()  # set by the pump on each line and when the output ends
        threading.Thread(target=_pump_lines, args=(process.stdout, lines, output), daemon=True).start()
        events = EventTail(run_dir / EVENTS_FILE_NAME)
        outbox = Outbox()
        stall = StallWatch(spec.training.stall_timeout_s)
        stalled = False
        seq = 0
        next_sync = 0.0
        output_done = False
        preempted_because: str | None = None  # set once we asked the training to stop at a checkpoint
        while True:
            exit_code = process.poll()
            if self.shutting_down.is_set() and preempted_because is None and exit_code is None:
                preempted_because = self._preempt(process, f"host {self.host_name} shut down")
            output.clear()  # a line from here on wakes the next wait
            while True:  # move the training output into the outbox
                try:
                    line = lines.get_nowait()
                except queue.Empty:
                    break
                if line is None:
                    output_done = True
                    break
                rank, line = split_rank(line, claimed.node_rank, spec)
                outbox.logs.append((seq, rank, line[:MAX_LOG_LINE]))
                outbox.recent_logs = (outbox.recent_logs + [line[:MAX_LOG_LINE]])[-REASON_LOG_LINES:]
                seq += 1
            for event in events.read():
                if event["type"] == "metrics":
                    outbox.metrics += [(event["step"], name, float(value)) for name, value in event["values"].items()]
                    stall.progressed()
                elif event["type"] == "checkpoint":
                    path = Path(event["path"]).resolve()
                    if path.is_relative_to(run_dir):  # the worker deletes it once stored: nothing outside the attempt
                        outbox.checkpoints.append((int(event["step"]), path))
                    else:
                        log.warning("job %s: checkpoint %s is outside the attempt's directory %s; not stored", claimed.job_id, path, run_dir)
            if exit_code is None and not stalled and stall.expired():
                # A hung rank (a dead collective peer, a stuck read) keeps the lease alive through
                # us, so nothing else would ever notice. It won't answer SIGTERM: kill the group.
                log.warning("job %s attempt %s: %s", claimed.job_id, claimed.number, stall.reason)
                _stop(process, grace_seconds=0)
                stalled = True

            finished = exit_code is not None and output_done
            if finished or time.monotonic() >= next_sync:
                next_sync = time.monotonic() + self.settings.heartbeat_seconds
                lease = self._sync(claimed, spec, outbox)
                if lease is not None and not lease.held:
                    _stop(process)
                    return None, "lease lost"
                # A rank that failed after the cancel failed because of it: in a gang, the ranks of
                # another node stopped first and took this node's collectives down with them.
                if lease is not None and lease.cancel_requested and not (finished and exit_code == 0):
                    _stop(process)
                    self._sync(claimed, spec, outbox, wait=True)
                    return AttemptStatus.cancelled, "cancelled by user"
                if lease is not None and lease.preempt_requested and preempted_because is None and exit_code is None:
                    preempted_because = self._preempt(process, "preempted for a higher-priority job")
            if finished and outbox.empty():
                break
            if finished:
                time.sleep(1.0)  # only the outbox left to deliver: retry it
            else:
                # Until the training writes a line or its output ends, at most half a second (a
                # tenth once the output has ended, for the exit), at least a tenth: this process
                # shares the cores with the training, and each wake-up is taken from it.
                woke = time.monotonic()
                output.wait(0.1 if output_done else 0.5)
                time.sleep(max(0.0, woke + 0.1 - time.monotonic()))

        if exit_code == 0:
            return AttemptStatus.succeeded, None
        if stalled:
            return AttemptStatus.failed, stall.reason
        # Accelerate's launcher turns any failed child into exit code 1 (and dies on SIGTERM
        # itself), so what counts is that we asked for the stop, not the code we got back.
        if preempted_because or exit_code == EXIT_PREEMPTED:
            return AttemptStatus.preempted, f"{preempted_because or 'SIGTERM'}; stopped at a checkpoint"
        tail = "\n".join(outbox.recent_logs[-REASON_LOG_LINES:])
        return AttemptStatus.failed, f"training process exited with code {exit_code}; last output:\n{tail}"

    @staticmethod
    def _preempt(process: subprocess.Popen, reason: str) -> str:
        """The training loop answers SIGTERM with a checkpoint at the next step, then exits."""
        os.killpg(process.pid, signal.SIGTERM)
        return reason

    def _wait_for_node_0(self, claimed: ClaimedAttempt) -> str | None:
        """host:port of node 0 of our try, once it has claimed its attempt (the other nodes of a
        gang start only then), holding our lease meanwhile. None if that takes too long."""
        deadline = time.monotonic() + self.node_0_wait_seconds
        while time.monotonic() < deadline:
            try:
                with self.sessions() as session:
                    rendezvous = gang_rendezvous(session, claimed)
                    if rendezvous is not None or not renew_lease(session, claimed, self.settings.lease_seconds).held:
                        return rendezvous  # None if not held: the gang ended meanwhile
            except Exception:
                log.exception("could not reach the database for job %s; will retry", claimed.job_id)
            time.sleep(0.5)
        return None

    def _sync(self, claimed: ClaimedAttempt, spec: JobSpec, outbox: Outbox, wait: bool = False) -> Lease | None:
        """Deliver the outbox and renew the lease. On a database error keep everything for next time.
        A checkpoint still being taken into the store after INGEST_WAIT_SECONDS is recorded by a
        later sync, unless this one `wait`s for it."""
        try:
            with self.sessions() as session:
                if outbox.metrics:
                    record_metrics(session, claimed.job_id, claimed.attempt_id, outbox.metrics)
                    outbox.metrics = []
                if outbox.logs:
                    record_logs(session, claimed.job_id, claimed, outbox.logs)
                    outbox.logs = []
                self._store_checkpoints(session, claimed, spec, outbox, wait)
                return renew_lease(session, claimed, self.settings.lease_seconds)
        except Exception:
            log.exception("could not reach the database for job %s; will retry", claimed.job_id)
            return None

    def _store_checkpoints(self, session, claimed: ClaimedAttempt, spec: JobSpec, outbox: Outbox, wait: bool) -> None:
        """Take the outbox's checkpoints into the store one at a time, oldest first, on the ingest
        threads, and record each that is in."""
        while outbox.checkpoints:
            step, source = outbox.checkpoints[0]
            if outbox.ingesting is None:
                outbox.ingesting = self.ingest.submit(self.store.ingest_checkpoint, source, claimed.job_id, step)
            if not wait_for([outbox.ingesting], timeout=None if wait else INGEST_WAIT_SECONDS).done:
                return
            ingesting, outbox.ingesting = outbox.ingesting, None
            try:
                relative, sha256, size = ingesting.result()
            except CorruptCheckpoint:
                # Retrying can't mend a missing or corrupt directory; the next checkpoint will do.
                log.exception("job %s: checkpoint of step %s at %s cannot be stored; skipped", claimed.job_id, step, source)
                outbox.checkpoints.pop(0)
                continue
            stale = record_checkpoint(
                session, claimed.job_id, claimed.attempt_id, step, relative, sha256, size, spec.checkpoint.keep_last
            )
            for path in stale:
                self.store.delete(path)
            outbox.checkpoints.pop(0)
            shutil.rmtree(source, ignore_errors=True)  # the store has it now (moved, or copied: the loop leaves it to us)

    def _finish(self, claimed: ClaimedAttempt, outcome: AttemptStatus | None, reason: str | None) -> None:
        if outcome is None:
            log.warning("job %s attempt %s: %s", claimed.job_id, claimed.number, reason)
            return
        # The outcome must reach the database: retry until it does or our lease is gone.
        while True:
            try:
                with self.sessions() as session:
                    ended = finish_attempt(session, claimed, outcome, reason)
                log.info("job %s attempt %s %s%s", claimed.job_id, claimed.number, outcome.value, "" if ended else " (too late: lease lost)")
                return
            except Exception:
                log.exception("could not record the end of job %s attempt %s; retrying", claimed.job_id, claimed.number)
                time.sleep(2)


RANK_PREFIX = re.compile(r"^\[default(\d+)\]:")


def split_rank(line: str, node_rank: int, spec: JobSpec) -> tuple[int | None, str]:
    """(global rank of the process that printed it, the line without torchrun's prefix). A single
    process is rank 0; in a multi-process job a line with no prefix is the launcher's own (None)."""
    if spec.world_size == 1:
        return 0, line
    match = RANK_PREFIX.match(line)
    if match is None:
        return None, line
    return node_rank * spec.resources.processes_per_node + int(match.group(1)), line[match.end():]


def _pump_lines(stream, lines: queue.Queue, output: threading.Event) -> None:
    for raw in stream:
        lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
        output.set()
    lines.put(None)
    output.set()


def _stop(process: subprocess.Popen, grace_seconds: float = 15.0) -> None:
    """SIGTERM the whole process group (launcher and ranks), then SIGKILL whatever remains;
    with no grace, SIGKILL at once.

    The launcher may exit before its ranks do, so wait for the group to be empty, not for it."""
    signals = [(signal.SIGTERM, grace_seconds)] if grace_seconds > 0 else []
    for sig, wait in signals + [(signal.SIGKILL, 5.0)]:
        deadline = time.monotonic() + wait
        try:
            os.killpg(process.pid, sig)
            while time.monotonic() < deadline:
                process.poll()  # reap the launcher, so the group can empty
                os.killpg(process.pid, 0)  # raises once no process of the group is left
                time.sleep(0.1)
        except ProcessLookupError:
            return
