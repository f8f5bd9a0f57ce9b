"""A Slurm partition as a pool. Trainyard decides what runs next; Slurm places it.

A job naming the pool (`resources.pool`) is not placed on hosts by the scheduler's pass: its try
gets one attempt per node at once, "on" the pool (pool_host), and is handed to Slurm here as one
batch job asking for its nodes, CPUs, GPUs, memory and time. In the allocation, one agent per node
(`srun`, workers/slurm_agent.py) takes the attempt of its node (SLURM_NODEID) through the worker
protocol, with a token that acts only on this job's attempts, and runs it as a registered host
would: the same sandbox, the same supervisor, checkpoints into the same store.

Both ways, each pass (`sync`):
- a cancel → `scancel`; the agents also see it in their lease;
- Slurm ends the try (preemption, `scancel` by an admin, a failed node, a time limit): the agents
  answer SIGTERM with a checkpoint and report the attempt preempted (failed, using a restart, when
  it was an `scancel` by someone other than Trainyard); what they could not report
  is ended here (lost: queued again, resuming from the newest checkpoint). Slurm never requeues
  (`--no-requeue`): a second copy of a try never runs;
- its state and why a pending one waits (`PENDING (Resources)`) go into the attempt for the API.
"""

from __future__ import annotations

import logging
import math
import os
import pwd
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from itertools import groupby
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

from api_schemas import AttemptStatus, JobSpec, JobStatus
from api_schemas.host_api import UNREACHABLE_FILE
from service.backends.slurm_commands import BatchJob, SlurmCommands, SlurmError, SlurmJob
from service.backends.slurm_rest import SlurmRest
from service.db import state
from service.db.host_tokens import issue_host_token, revoke_host_token
from service.db.models import Attempt, Job
from service.db.pools import forget_pool_if_moved, pool_named, record_pool, set_cluster_state, unsettled_attempts
from service.db.scheduling import pool_host
from service.logs import job_fields
from common.settings import Settings

log = logging.getLogger("trainyard.scheduler")

# Slurm states of a job that has not ended yet (COMPLETING: its processes are being cleaned up).
_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
# Ended having run the batch script: a try that never claimed its attempt then had an agent that
# could not start (wrong Python, no shared storage), which another try would not mend.
_RAN = {"COMPLETED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY"}
RESUBMIT_AFTER_SECONDS = 10.0  # a try placed but not handed over (sbatch failed, or the scheduler stopped) is sent again after this
DESCRIBE_EVERY_SECONDS = 60.0
DESCRIBE_RETRY_SECONDS = 30  # after a failed description (sinfo refused, the controller down)
# A batch job asks Slurm for this much more than the job's runtime limit: Trainyard's supervisor
# stops it first, and says why.
RUNTIME_MARGIN_MINUTES = 5
REAP_AFTER_SECONDS = 30.0  # an allocation left running this long after all its attempts ended is cancelled
REPEAT_FAILURE_SECONDS = 60.0  # the same failure to read the queue is logged again this often


def slurm_client(settings: Settings) -> SlurmCommands | SlurmRest:
    """Slurm's commands, or its REST API where the settings name slurmrestd: the same four calls."""
    if settings.slurm_rest_url:
        user = settings.slurm_user or pwd.getpwuid(os.getuid()).pw_name
        return SlurmRest(settings.slurm_rest_url, user, settings.slurm_jwt_file, settings.resolved_work_root)
    return SlurmCommands(settings.slurm_bin_dir)


@dataclass(frozen=True)
class Try:
    """One try of a pool job as the database had it when a sync began: its attempts in node order."""

    job_id: int
    number: int
    ids: list[int]
    active: bool  # some attempt still scheduled or running
    cancel_requested: bool
    cluster_job_id: str | None
    cluster_state: str | None
    handed_at: datetime  # when the pass placed it
    finished_at: list[datetime | None]

    @classmethod
    def of(cls, attempts: list[Attempt]) -> Try:
        attempts = sorted(attempts, key=lambda a: a.node_rank)
        first = attempts[0]
        return cls(
            first.job_id, first.number, [a.id for a in attempts], any(a.status in state.ACTIVE_ATTEMPT for a in attempts),
            first.job.cancel_requested, first.cluster_job_id, first.cluster_state, first.dispatched_at, [a.finished_at for a in attempts],
        )

    def ended_before(self, moment: float) -> bool:
        return all(finished is not None and finished.timestamp() < moment for finished in self.finished_at)


def last_line(path: Path, most: int = 300) -> str | None:
    """The last line of a file that says something (the error an agent that never started left in
    Slurm's output: `execve(): …: No such file or directory`), cut to `most` characters; None if none."""
    try:
        with path.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 4096))
            tail = file.read().decode(errors="replace")
    except OSError:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:most] if lines else None


class SlurmBackend:
    def __init__(self, sessions: sessionmaker, settings: Settings, commands: SlurmCommands | SlurmRest | None = None):
        self.sessions, self.settings = sessions, settings
        self.pool, self.partition = settings.slurm_pool, settings.slurm_partition
        self.slurm = commands or slurm_client(settings)
        self.described_at = 0.0
        self.queue_failure, self.queue_failure_said_at = "", 0.0  # the last failure to read the queue, and when it was logged

    # -- handing tries over --------------------------------------------------------------------

    def start(self, placed: list[tuple[int, str]]) -> None:
        with self.sessions() as session:
            rows = session.execute(
                select(Attempt.job_id, Attempt.number, Attempt.id).where(Attempt.id.in_([a for a, _ in placed])).order_by(Attempt.node_rank)
            ).all()
            session.commit()
        for (job_id, number), attempts in groupby(sorted(rows, key=lambda r: (r.job_id, r.number)), key=lambda r: (r.job_id, r.number)):
            self._submit(job_id, number, [row.id for row in attempts])

    def _submit(self, job_id: int, number: int, ids: list[int], known: dict[str, SlurmJob] | None = None) -> None:
        """Hand one try (its attempts' ids in node order) to Slurm, once: a batch job of its name
        already in Slurm's queue (sent by a pass that stopped before recording it) is taken as
        this try's."""
        name = f"trainyard-{job_id}-{number}"
        fields = job_fields(job_id, ids[0])
        try:
            if known is not None and (existing := next((job for job in known.values() if job.name == name), None)):
                with self.sessions() as session:
                    set_cluster_state(session, ids, existing.shown, existing.id)
                return
            with self.sessions() as session:
                spec = session.scalar(select(Job.spec).where(Job.id == job_id))
                max_minutes = pool.info.get("max_minutes") if (pool := pool_named(session, self.pool)) else None
                directory = self.try_directory(job_id, number)
                directory.mkdir(parents=True, exist_ok=True)
                token_file = directory / "token"
                token_file.touch(mode=0o600)
                token_file.write_text(issue_host_token(session, pool_host(self.pool, job_id)))  # replaces the last try's
            batch = self.batch_job(name, JobSpec.from_stored(spec), directory, ids, max_minutes)
            cluster_job_id = self.slurm.submit(batch)
        except SlurmError as exc:
            if exc.transient:
                log.warning("could not hand job %s to Slurm (%s); trying again in %.0f s", job_id, exc, RESUBMIT_AFTER_SECONDS, extra=fields)
                return
            log.warning("Slurm refused job %s: %s", job_id, exc, extra=fields)
            refusal = f"Slurm refused it: {exc}"
            self._end(ids, lambda attempt: (AttemptStatus.failed, refusal, False), "REFUSED")
            return
        with self.sessions() as session:
            set_cluster_state(session, ids, "PENDING", cluster_job_id)
        log.info("job %s attempt %s handed to Slurm as job %s", job_id, number, cluster_job_id, extra=fields)

    def try_directory(self, job_id: int, number: int) -> Path:
        """On the storage the compute nodes share: the try's token file and Slurm's output."""
        return self.settings.resolved_work_root / "slurm" / f"job{job_id}-{number}"

    def batch_job(self, name: str, spec: JobSpec, directory: Path, attempt_ids: list[int], max_minutes: int | None = None) -> BatchJob:
        """The try's batch job; `max_minutes`: the partition's time limit, if it has one."""
        s, resources = self.settings, spec.resources
        hours = resources.max_runtime_hours or s.max_runtime_hours
        if max_minutes is not None and hours * 60 + RUNTIME_MARGIN_MINUTES > max_minutes:
            # A partition with a time limit (MaxTime) keeps a job that asks for more pending for
            # ever: there, the job's limit is the partition's, less the margin.
            hours = max(max_minutes - RUNTIME_MARGIN_MINUTES, max_minutes / 2) / 60
        environment = {
            # Only what a worker host is given: the API and the try's token, the shared paths, the
            # service's timing (which a registered host learns as it registers).
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "TRAINYARD_API_URL": s.slurm_api_url or s.api_url,
            "TRAINYARD_HOST_TOKEN_FILE": str(directory / "token"),
            "TRAINYARD_DATA_DIR": str(s.data_dir.resolve()),
            "TRAINYARD_ARTIFACT_ROOT": str(s.resolved_artifact_root),
            "TRAINYARD_DATA_ROOT": str(s.resolved_data_root),
            "TRAINYARD_WORK_ROOT": str(s.resolved_work_root),
            "TRAINYARD_PLUGIN_DIR": str(s.resolved_plugin_dir),
            "TRAINYARD_ENVIRONMENT_ROOT": str(s.resolved_environment_root),
            "TRAINYARD_HEARTBEAT_SECONDS": str(s.heartbeat_seconds),
            "TRAINYARD_LEASE_SECONDS": str(s.lease_seconds),
            "TRAINYARD_DISPATCH_TIMEOUT_SECONDS": str(s.dispatch_timeout_seconds),
            "TRAINYARD_MAX_RUNTIME_HOURS": str(hours),
            "TRAINYARD_MAX_ATTEMPT_DISK_GB": str(s.max_attempt_disk_gb),
            "TRAINYARD_MAX_LOG_LINES_PER_ATTEMPT": str(s.max_log_lines_per_attempt),
            "TRAINYARD_LOG_FORMAT": s.log_format,
        }
        threads = 1  # each process's threads: the CPUs asked per process
        command = [s.slurm_python or sys.executable, "-m", "trainyard", "slurm-agent", "--attempts", ",".join(map(str, attempt_ids)), "--threads", str(threads)]
        if spec.may_start_warm:  # the agent loads torch while it claims the attempt (workers/warm_pool.py)
            command.append("--warm")
        return BatchJob(
            name=name, partition=self.partition, nodes=resources.nodes, cpus_per_node=resources.processes_per_node,
            gpus_per_node=resources.processes_per_node if resources.device == "cuda" else 0, memory_gb=resources.memory_gb,
            # Past Trainyard's own runtime limit, so the supervisor stops it first and says why.
            minutes=min(math.ceil(hours * 60) + RUNTIME_MARGIN_MINUTES, max_minutes or math.inf), output=directory / "slurm-%j.out", environment=environment, command=command,
            account=s.slurm_account, qos=s.slurm_qos,
        )

    # -- reconciling -----------------------------------------------------------------------------

    def sync(self) -> None:
        self._describe_if_due()
        with self.sessions() as session:
            tries = [Try.of(list(attempts)) for _, attempts in groupby(unsettled_attempts(session, self.pool), key=lambda a: (a.job_id, a.number))]
            session.commit()
        if not tries:
            return
        try:
            queue = self.slurm.queue()  # no transaction open while Slurm answers
        except SlurmError as exc:
            # Said again once a minute while it lasts (an expired token's line came every pass, 2 s apart).
            if (said := str(exc)) != self.queue_failure or time.monotonic() - self.queue_failure_said_at >= REPEAT_FAILURE_SECONDS:
                log.warning("could not read Slurm's queue (%s); trying again each pass", said)
                self.queue_failure, self.queue_failure_said_at = said, time.monotonic()
            return
        self.queue_failure = ""
        for one in tries:
            try:
                self._sync_try(one, queue)
            except SlurmError as exc:
                log.warning("job %s attempt %s: %s; trying again next pass", one.job_id, one.number, exc, extra=job_fields(one.job_id))

    def _sync_try(self, one: Try, queue: dict[str, SlurmJob]) -> None:
        job_id, number, ids = one.job_id, one.number, one.ids
        if one.cluster_job_id is None:  # never handed over: sbatch failed for a while, or the scheduler stopped before it
            if one.active and time.time() - one.handed_at.timestamp() > RESUBMIT_AFTER_SECONDS:
                self._submit(job_id, number, ids, known=queue)
            elif not one.active:
                with self.sessions() as session:
                    set_cluster_state(session, ids, "REFUSED")
            return
        slurm_job = queue.get(one.cluster_job_id)
        slurm_state = slurm_job.state.split()[0] if slurm_job else "VANISHED"  # gone from Slurm's memory (MinJobAge)
        if slurm_state in _LIVE:
            # COMPLETING: Slurm is ending it already (after our scancel, or its own end); asked again each pass, it only adds load.
            stop = one.cancel_requested or (not one.active and one.ended_before(time.time() - REAP_AFTER_SECONDS))
            if stop and slurm_state != "COMPLETING":
                self.slurm.cancel(one.cluster_job_id)  # its next state, CANCELLED, ends the rest below
                log.info("cancelled Slurm job %s of job %s", one.cluster_job_id, job_id, extra=job_fields(job_id))
            if slurm_job.shown != one.cluster_state:
                with self.sessions() as session:
                    set_cluster_state(session, ids, slurm_job.shown)
            return
        if slurm_job is None and one.active:
            # Gone from our view of the queue while its try is on: cancelled all the same (harmless
            # for a job Slurm forgot), so a job we only fail to see never runs beside the next try.
            try:
                self.slurm.cancel(one.cluster_job_id)
            except SlurmError:
                pass
        # Slurm is done with the try: what its agents did not report ends here.
        if one.active:
            def outcome(attempt: Attempt) -> tuple[AttemptStatus, str, bool]:
                said = f"Slurm job {one.cluster_job_id} ended {slurm_state}"
                if one.cancel_requested:
                    return AttemptStatus.cancelled, "cancelled by user", True
                if attempt.status == AttemptStatus.running:
                    return AttemptStatus.lost, f"{said} while the attempt ran", True
                if slurm_state in _RAN:
                    directory = self.try_directory(job_id, number)
                    if (unreachable := directory / UNREACHABLE_FILE).is_file():
                        return AttemptStatus.lost, f"{said}: its agent could not reach the API ({unreachable.read_text().strip()})", True
                    output = directory / f"slurm-{one.cluster_job_id}.out"
                    said_last = f": {last}" if (last := last_line(output)) else ""
                    return AttemptStatus.failed, f"{said} before its agent took the attempt{said_last} (see {output})", False
                return AttemptStatus.lost, f"{said} before the attempt started", True
            self._end(ids, outcome, slurm_state)
        else:
            with self.sessions() as session:
                set_cluster_state(session, ids, slurm_state)
        self._clean_up(job_id, number)

    def _end(self, attempt_ids: list[int], outcome, cluster_state: str) -> None:
        """End each attempt still active through the state machine with outcome(attempt) → (status, reason, retry)."""
        with self.sessions() as session:
            for attempt_id in attempt_ids:
                attempt = session.get(Attempt, attempt_id, populate_existing=True)
                if attempt is not None and attempt.status in state.ACTIVE_ATTEMPT:  # a node's end may have ended its gang
                    status, reason, retry = outcome(attempt)
                    state.end_attempt(session, attempt.job, attempt, status, reason, retry=retry)
                    log.warning("job %s attempt %s node %s %s: %s", attempt.job_id, attempt.number, attempt.node_rank, status.value, reason,
                                extra=job_fields(attempt.job_id, attempt.id))
            session.commit()
            set_cluster_state(session, attempt_ids, cluster_state)

    def _clean_up(self, job_id: int, number: int) -> None:
        """The try's token file goes with it; the job's token once the job is over (a later try
        gets a new one, which replaces it)."""
        (self.try_directory(job_id, number) / "token").unlink(missing_ok=True)
        with self.sessions() as session:
            if JobStatus(session.scalar(select(Job.status).where(Job.id == job_id))).is_final:
                revoke_host_token(session, pool_host(self.pool, job_id))
            session.commit()

    def _describe_if_due(self) -> None:
        """What one node of the partition offers, for admission to check jobs against (GET /v1/pools)."""
        if time.monotonic() - self.described_at < DESCRIBE_EVERY_SECONDS:
            return
        try:
            info = self.slurm.partition(self.partition)
        except SlurmError as exc:
            # Tried again in a while, not every pass (a misnamed partition wrote this line every 2 s).
            log.warning("could not describe Slurm partition %s (TRAINYARD_SLURM_PARTITION): %s; trying again in %d s",
                        self.partition, exc, DESCRIBE_RETRY_SECONDS)
            self.described_at = time.monotonic() - DESCRIBE_EVERY_SECONDS + DESCRIBE_RETRY_SECONDS
            with self.sessions() as session:
                if forget_pool_if_moved(session, self.pool, self.partition):
                    log.warning("pool %s unlisted until partition %s is described: its description was another partition's", self.pool, self.partition)
            return
        with self.sessions() as session:
            record_pool(session, self.pool, "slurm", info)
        self.described_at = time.monotonic()

