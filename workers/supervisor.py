"""Runs one attempt of a job on this host, from claim to final status.

The Celery message only says "run attempt X". The supervisor claims X through the service's API
(workers/host_client.py) with a lease (a duplicate delivery finds it claimed and does nothing), launches the training processes
with Accelerate's launcher (their command and environment: workers/launch.py), and while they run
(RunningAttempt): renews the lease, stops them on cancel, kills them when they stop making steps
(`training.stall_timeout_s`), and forwards what the training loop wrote (metrics and checkpoint
events in a JSONL file, stdout and stderr, a script's `outputs` directories) to the artifact store
and, through the API, the database. The events file and the outbox (workers/outbox.py) are the worker-side buffer: if
the API is unreachable for a while, nothing is lost, it is delivered on the next successful sync.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_for
from functools import partial
from pathlib import Path
from typing import NamedTuple

from api_schemas import AttemptStatus, CheckpointConfig, JobEventType, JobSpec
from api_schemas.host_api import (
    INT32_MAX, INT32_MIN, MAX_LINE_CHARS, MAX_LINES_PER_REPORT, MAX_METRIC_NAME_CHARS, MAX_POINTS_PER_REPORT, MAX_REFUSED_PER_REPORT,
    MAX_WHAT_CHARS, ClaimedAttempt, Lease, RefusedTransfer, Rendezvous, Reported, Rollback,
)
from api_schemas.manifest import CorruptCheckpoint, checkpoint_name
from api_schemas.requirements import unmet
from api_schemas.worker_protocol import EXIT_PREEMPTED, CheckpointEvent, InvalidSpecEvent, MetricsEvent, SpikeEvent
from common.settings import Settings
from workers.attempt_dirs import EndedAttempts
from workers.environments import Environment, EnvironmentCache, EnvironmentFailed
from workers.job_paths import NotTheJobs, copy_out, take_out
from workers.host_client import HostClient, NotOurs, ServiceError, ServiceRefused, ServiceUnreachable
from workers.launch import (
    EVENTS_FILE_NAME, SPEC_FILE_NAME, attempt_dir, enter_job_env, launch_command, process_threads, training_environment, working_dir,
)
from workers.limits import AttemptLimits, Bounds, DiskWatch, SlotShare, limited
from workers.sandbox import (
    INPUT_COPIES, MAX_OPEN_FILES, MAX_PROCESSES, AttemptView, HostSandbox, job_inputs, plugin_module, prepare_attempt, sandbox_command,
    service_state,
)
from workers.warm_pool import WarmPool, place_inputs
from workers.run_environment import changed_inputs, digest, input_digests, run_environment
from workers.gang_network import GANG_INTERFACE, GangNetwork, GangNetworkFailed
from workers.loss_guard import LoggedLossWatch, Spike
from workers.outbox import MAX_LOG_LINE, DroppedLines, EventTail, Outbox
from workers.store_access import SharedStore, StoreThroughApi
from workers.system_metrics import SystemSampler

log = logging.getLogger("trainyard.worker")

REASON_LOG_LINES = 20
# How long a sync waits for a checkpoint being taken into the store before it renews the lease
# anyway (a move takes milliseconds; a copy to another filesystem, and its hash, can take minutes).
INGEST_WAIT_SECONDS = 1.0
# What one sync stores, after it has renewed the lease: batches of at most this many lines and points,
# for at most DELIVERY_SECONDS; a backlog goes on at the next round, so a burst of a million lines or
# points never delays the lease, a cancel or a SIGTERM by more than that and one batch (it was 46 s
# past a 30 s lease). A batch a fifth of what the API takes in one report is stored in ~0.5 s: a full
# one took 2-3.5 s, and 8 s on a slower, busier host, where a renewal came 16.8 s after the last.
LINES_PER_BATCH = MAX_LINES_PER_REPORT // 5
POINTS_PER_BATCH = MAX_POINTS_PER_REPORT // 5
DELIVERY_SECONDS = 1.0
# Between heartbeats, what is new (a step's metrics, a checkpoint, lines) is forwarded at once, at
# most this often: seen through the API within half a second of the training writing it, batched
# only when it comes faster than this, or when the API asks for fewer reports (many hosts report:
# service/api/report_pacing.py). The lease is renewed on the heartbeat alone.
FORWARD_SECONDS = 0.25
# How often an attempt's directory is measured against its disk limit: a job writing at 1 GB/s is
# over it by a few GB at most when stopped.
DISK_WATCH_SECONDS = 2.0
OUT_OF_REACH_NOTE_SECONDS = 60.0  # while the service is out of reach, an attempt's log says so this often
CPU_HELD_BACK_NOTED = 0.2  # the share of its time a job is held to its cores before its logs say so
# Each heartbeat (a lease renewal, an idle host's after its first) comes a random part of this share
# of the period early; an attempt's first renewal anywhere within the period (heartbeat_pause).
HEARTBEAT_JITTER = 0.2
# How long a run that reported its last step is let finish (its last checkpoint, its exit) before a
# cancel or preemption stops it all the same.
FINISHING_GRACE_SECONDS = 120.0


def heartbeat_pause(heartbeat: float, first: bool = False) -> float:
    """Seconds to the next heartbeat: a little less than `heartbeat`, by a random amount, and for
    the `first` anywhere within it. Hosts that start together (a cluster's restart, a sweep's
    trials claimed in one scheduler pass) would otherwise beat in step for as long as they run: at
    500 running attempts, most of a period's renewals in one second of it, each waiting behind the
    others (bench/agents.py), where spread they are 100 a second."""
    return heartbeat * random.uniform(0.0 if first else 1.0 - HEARTBEAT_JITTER, 1.0)


def forward_pause(round_trip: float) -> float:
    """Seconds until the next forward after one that took `round_trip`: FORWARD_SECONDS, or longer
    when the API is slow to answer (loaded by many hosts): each host then sends fewer, larger
    reports, and the load it offers falls as the API's answers slow down, rather than queueing up."""
    return max(FORWARD_SECONDS, 4 * round_trip)


class FinalReason(str):
    """Why an attempt failed, when no retry can mend it (the training found the job's spec can't
    run): its job fails at once instead of being retried."""


class RollbackReason(str):
    """Why an attempt stopped when its loss guard saw the run diverge: the job rolls back (`spike`;
    `drop`: for a loop the worker watched, the checkpoints it wrote after the spike began)."""

    spike: SpikeEvent
    drop: list[str] | None = None


# What an attempt came to: the status to record, and why. No status: nothing to record (lease lost).
Outcome = tuple[AttemptStatus | None, str | None]


class Synced(NamedTuple):
    """What a sync heard: the lease (None: the service out of reach), and how soon the API asked for the next report."""

    lease: Lease | None
    next_report_seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # free on every interface: other hosts of a gang connect to it
        return s.getsockname()[1]


class StallWatch:
    """Time since the training last reported an optimizer step or a checkpoint (or, before either, since the start)."""

    def __init__(self, timeout_seconds: float | None):
        self.timeout_seconds = timeout_seconds
        self.last_progress = time.monotonic()

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    def expired(self) -> bool:
        return self.timeout_seconds is not None and time.monotonic() - self.last_progress > self.timeout_seconds

    @property
    def reason(self) -> str:
        return f"stalled: no optimizer step or checkpoint for {self.timeout_seconds:g} s; its processes were killed"


class CannotStart(Exception):
    """The attempt cannot run on this host; the message says why."""


class EndedBeforeStart(Exception):
    """The attempt ended while it was getting ready (cancelled, its lease lost, a rerun's input changed); `outcome` says how."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome[1])
        self.outcome = outcome


class AttemptRunner:
    def __init__(
        self, settings: Settings, service: HostClient, host_name: str, address: str = "127.0.0.1", sandbox: HostSandbox | None = None,
        warm: WarmPool | None = None, cpu_threads: int | None = None, share: SlotShare | None = None,
    ):
        self.settings, self.service, self.host_name, self.address = settings, service, host_name, address
        self.cpu_threads = cpu_threads  # threads of each CPU process: the cores of one slot of this host
        self.share = share  # what an attempt gets per slot it holds, unless its spec says; None: unbounded (a Slurm allocation bounds it)
        self.sandbox = sandbox or HostSandbox.detect(unsafe=False)
        self.warm = warm  # warm interpreters attempts may start from (workers/warm_pool.py); None: all start cold
        self.store = (  # where checkpoints go and resumes come from: workers/store_access.py
            SharedStore(settings.resolved_artifact_root, settings.resolved_data_root, settings.artifact_reader_gid) if settings.shared_artifact_store
            else StoreThroughApi(service, settings.resolved_work_root / "store-transfers", int(settings.fetch_cache_gb * 2**30))
        )
        self.ended_attempts = EndedAttempts(settings.failed_attempt_retention_hours)  # their directories, removed in time
        # Checkpoints are taken into the store off the supervising thread: one copied to another
        # filesystem and hashed can take longer than a lease lasts, and must not keep it from renewal.
        self.ingest = ThreadPoolExecutor(max_workers=4, thread_name_prefix="checkpoint-ingest")
        self.environments = EnvironmentCache(
            settings.resolved_environment_root, settings.environment_max_bytes, settings.environment_index_url,
            settings.environment_find_links, settings.environment_no_index,
        )
        self.shutting_down = threading.Event()
        # Why the host went away, when not to be preempted for (workers/slurm_agent.py: its Slurm job
        # cancelled by someone else); None: a preemption, which costs the job no restart.
        self.stopped_for_good: Callable[[], str | None] = lambda: None
        self.out_of_reach_noted: dict[int, float] = {}  # attempt id → when its log last said the service is out of reach
        self.gang_networks: dict[int, GangNetwork] = {}  # the running gang attempts' own networks, by attempt id

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
        rendezvous = f"{self.address}:{free_port()}"  # used if we are node 0
        claimed = self.service.claim(attempt_id, lease_owner, rendezvous)  # a lost answer: the scheduler sends it again
        if claimed is None:
            log.info("attempt %s is not ours to run (already claimed, ended or cancelled)", attempt_id)
            return
        log.info("running job %s attempt %s (resume from step %s)", claimed.job_id, claimed.number, claimed.resume_step)
        try:
            outcome, reason = self._supervise(claimed)
        except Exception as exc:  # noqa: BLE001 - a bug of ours, or a stored spec nothing checked: say so now,
            # rather than leave the attempt "running" until its lease runs out and the job is told its host went away.
            log.exception("job %s attempt %s could not be run", claimed.job_id, claimed.number)
            outcome, reason = AttemptStatus.failed, f"the worker could not run it: {type(exc).__name__}: {exc}"
        self._finish(claimed, outcome, reason)
        self.out_of_reach_noted.pop(claimed.attempt_id, None)
        self.store.release(claimed)
        self.ended_attempts.ended(self._run_dir(claimed), outcome)
        self.ended_attempts.sweep()

    def _run_dir(self, claimed: ClaimedAttempt) -> Path:
        node_rank = claimed.node_rank if claimed.spec["resources"].get("nodes", 1) > 1 else None
        return attempt_dir(self.settings.resolved_work_root, claimed.job_id, claimed.number, node_rank)

    # -- the attempt's life ----------------------------------------------------------------------

    def _supervise(self, claimed: ClaimedAttempt) -> Outcome:
        spec = JobSpec.from_stored(claimed.spec)
        outbox = Outbox()  # the environment's install log comes first
        environment = None
        try:
            try:
                if refusal := self.sandbox.refusal(spec):  # before anything is installed for it
                    raise CannotStart(refusal)
                self._fetch_from_store(claimed, outbox)
                inputs = self._inputs(claimed, spec)
                environment = self._prepare_environment(claimed, spec, outbox)
                run_dir, process, limits = self._start(claimed, spec, environment)
                self._report_environment(claimed, spec, inputs, environment)
            except CannotStart as exc:
                if not outbox.empty():
                    self._sync(claimed, outbox)  # the install log that says why
                return AttemptStatus.failed, str(exc)
            except EndedBeforeStart as exc:
                return exc.outcome
            try:
                return RunningAttempt(self, claimed, spec, run_dir, process, limits, outbox).supervise()
            finally:
                if limits is not None:
                    limits.remove()
        finally:
            if (network := self.gang_networks.pop(claimed.attempt_id, None)) is not None:
                network.close()
            if environment is not None:
                environment.release()  # no longer in use: it may be collected
            if self.warm is not None:
                self.warm.fill()  # replace the interpreter this attempt may have used, now that it no longer needs the cores

    def _inputs(self, claimed: ClaimedAttempt, spec: JobSpec) -> dict[str, str]:
        """The digests of the attempt's inputs (its script's code too); a rerun's that differ from
        those of the job it reruns end the attempt, for good: the next would read the same."""
        inputs = input_digests(spec, self.settings, self.store.data_root(claimed))
        if claimed.code_path is not None and Path(claimed.code_path).is_dir():
            inputs["code"] = digest(Path(claimed.code_path))
        if spec.inputs_sha256 and (changed := changed_inputs(spec.inputs_sha256, inputs)):
            self._report_environment(claimed, spec, inputs, None)  # what it found, for `trainyard diff`
            raise EndedBeforeStart((AttemptStatus.failed, FinalReason(changed)))
        return inputs

    def _report_environment(self, claimed: ClaimedAttempt, spec: JobSpec, inputs: dict[str, str], environment: Environment | None) -> None:
        """Its part of the job's run record; one that can't be sent is logged, the attempt goes on."""
        try:
            site_packages = environment.site_packages if environment is not None else None
            threads = process_threads(spec, self.cpu_threads) if spec.resources.device == "cpu" else None
            self.service.environment(claimed, run_environment(spec, inputs, claimed.device_ids, site_packages, threads))
        except (ServiceError, OSError, ValueError):
            log.exception("job %s attempt %s: its run environment was not recorded", claimed.job_id, claimed.number)

    def _prepare_environment(
        self, claimed: ClaimedAttempt, spec: JobSpec, outbox: Outbox
    ) -> Environment | None:
        """The job's `environment.pip` environment, cached or built, held in use. It is made on a
        thread of its own while this one forwards its install log to the job's logs and renews the
        lease every heartbeat (a build can take longer than a lease lasts, or wait for another
        attempt's build of it). Raises CannotStart if it can't be built, EndedBeforeStart if the
        attempt is cancelled or lost meanwhile."""
        if spec.environment is None:
            return None
        lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        # The build goes on for whoever wants it next if the attempt ends; what it holds is let go once it is done.
        preparing = self._renewing_lease_while(
            claimed, outbox, "environment", lambda: self.environments.acquire(spec.environment.pip, lines.put),
            abandoned=lambda built: built.exception() is None and built.result().release(), lines=lines,
        )
        try:
            return preparing.result()
        except EnvironmentFailed as exc:
            raise CannotStart(str(exc)) from exc

    def _fetch_from_store(self, claimed: ClaimedAttempt, outbox: Outbox) -> None:
        """What the attempt reads from the artifact store, onto this host if it doesn't mount it (a
        large checkpoint fetched through the API takes longer than a lease lasts). Raises CannotStart
        if it can't be had, EndedBeforeStart if the attempt ends meanwhile. On a host that mounts the
        store, nothing: no thread, no extra round trip on the way to every job's first step."""
        if not self.store.fetches:
            return
        fetching = self._renewing_lease_while(claimed, outbox, "store-fetch", lambda: self.store.prepare(claimed))
        try:
            fetching.result()
        except (CorruptCheckpoint, ServiceError) as exc:  # corrupt, refused, or not ours any more (then the finish is refused too)
            raise CannotStart(f"cannot fetch what it reads from the service on {self.host_name}: {exc}") from exc

    def _renewing_lease_while(
        self, claimed: ClaimedAttempt, outbox: Outbox, name: str, work: Callable, abandoned: Callable = lambda _done: None,
        lines: queue.SimpleQueue | None = None,
    ) -> Future:
        """`work()` on a thread of its own, done; meanwhile this one renews the lease every heartbeat
        and forwards the job's logs (and `lines` into them). If the attempt is cancelled or lost
        first, raises EndedBeforeStart and leaves `work` to finish, then `abandoned(its future)`."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        running = pool.submit(work)
        pool.shutdown(wait=False)
        while True:
            done = wait_for([running], timeout=self.settings.heartbeat_seconds).done
            while lines is not None and not lines.empty():
                outbox.add_line(None, lines.get())
            lease = self._sync(claimed, outbox).lease
            if done:
                return running
            if lease is not None and (not lease.held or lease.cancel_requested):
                running.add_done_callback(abandoned)
                raise EndedBeforeStart((None, "lease lost") if not lease.held else (AttemptStatus.cancelled, "cancelled by user"))

    def _start(
        self, claimed: ClaimedAttempt, spec: JobSpec, environment: Environment | None = None
    ) -> tuple[Path, subprocess.Popen, AttemptLimits | None]:
        """The attempt's directory, and its processes launched in it once node 0 of the job has
        started (in the job's own Python `environment` if it has one), with their cgroups if this
        host has them. Raises CannotStart if they can't be launched here."""
        run_dir = self._run_dir(claimed)
        resume_from = self.store.resume_directory(claimed)
        met = self._wait_for_gang(claimed)
        if met is None:
            whom = "every node" if claimed.net_address else "node 0"
            raise CannotStart(f"{whom} of this job did not start within {self.node_0_wait_seconds:.0f} s")
        rendezvous = met.rendezvous
        if self.sandbox.enabled and spec.resources.nodes == 1:  # its network namespace has loopback only
            rendezvous = f"127.0.0.1:{rendezvous.rpartition(':')[2]}"
        # An elastic job placed on fewer processes than its spec's launches that many; the training
        # reads the spec itself and accumulates to keep its optimizer step.
        placed = spec.placed_on(claimed.slots) if claimed.slots != spec.resources.processes_per_node else spec
        bounds = self._bounds(spec, claimed.slots)
        if environment is None and (started := self._start_warm(claimed, spec, placed, run_dir, resume_from, rendezvous, bounds)):
            return started
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / SPEC_FILE_NAME).write_text(json.dumps(claimed.spec))
        cwd = working_dir(spec, run_dir)
        if spec.script is not None:
            shutil.rmtree(cwd, ignore_errors=True)
            try:
                if claimed.code_path is None:
                    raise OSError(claimed.code_refused or "the service gave no code directory")
                shutil.copytree(claimed.code_path, cwd, symlinks=True)
            except OSError as exc:  # e.g. a code root that differs on this host
                raise CannotStart(f"cannot get the script's code on {self.host_name}: {exc}") from exc
            # Met by the job's environment: its own packages, then the worker's.
            search = None if environment is None else [str(environment.site_packages), *sys.path]
            if problems := unmet(spec.script.requirements, search):
                raise CannotStart(f"host {self.host_name} does not meet script.requirements: {'; '.join(problems)}")
        command = launch_command(
            placed, run_dir, self.store.data_root(claimed), resume_from, rendezvous, claimed.node_rank, self.settings.resolved_plugin_dir,
            resume_step=claimed.resume_step, skip_steps=claimed.skip_steps, python=str(environment.python) if environment is not None else sys.executable,
            cpu_threads=self.cpu_threads,
        )
        # The job's environment is applied by the last step in, as the job's user (workers/enter_job_env.py):
        # the shell, bwrap and setpriv before it run as the worker's user with an empty one.
        env = training_environment(spec, run_dir, resume_from, claimed.device_ids)
        command = enter_job_env(command, run_dir, env, init=self.sandbox.enabled)
        if self.sandbox.enabled:
            inputs = prepare_attempt(run_dir, job_inputs(spec, self.settings, self.store.data_root(claimed), resume_from))
            if environment is not None:  # read-only, at its own path (made readable by all when built)
                inputs += ((environment.path, environment.path),)
            view = AttemptView(
                run_dir, inputs, service_state(self.settings), host_network=spec.resources.nodes > 1,
                gpus=tuple(claimed.device_ids or ()), command_is_init=True, interface=GANG_INTERFACE if claimed.net_address else None,
                gang=tuple(node.address for node in sorted(met.gang, key=lambda node: node.node_rank)) if met.gang else (),
            )
            command = sandbox_command(command, cwd, view, self.sandbox.tool)
        if claimed.net_address:  # a gang's attempt, in a network that reaches its gang only
            try:
                network = GangNetwork.open(claimed.attempt_id, claimed.net_address, met.gang, {self.address})
            except (GangNetworkFailed, OSError) as exc:
                raise CannotStart(f"cannot make the attempt's network on {self.host_name}: {exc}") from exc
            self.gang_networks[claimed.attempt_id] = network
            command = network.command_prefix + command
        limits = None
        if self.sandbox.limits:
            # The worker's pid too: another service's worker on this machine (a second Trainyard, the
            # tests' stacks side by side) numbers its attempts alike, and set its limits on this one's.
            name = f"trainyard-attempt-{claimed.attempt_id}-{claimed.node_rank}-w{os.getpid()}"
            limits = AttemptLimits.create(name, bounds, MAX_PROCESSES)
        process = subprocess.Popen(
            limited(command, MAX_OPEN_FILES, limits, bounds.memory_bytes), cwd=cwd, env={}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        return run_dir, process, limits

    def _bounds(self, spec: JobSpec, slots: int) -> Bounds:
        """What the attempt may use here: the memory its spec asks for, else its slots' share of the
        host, and its slots' cores. Without cgroups only an asked-for limit holds (workers/limits.py)."""
        memory = int(spec.resources.memory_gb * 2**30) if spec.resources.memory_gb else None
        if self.share is None or not self.sandbox.limits:
            return Bounds(memory_bytes=memory)
        return Bounds(memory_bytes=memory or self.share.memory_bytes * slots, cpu_cores=self.share.cores * slots)

    def _start_warm(
        self, claimed: ClaimedAttempt, spec: JobSpec, placed: JobSpec, link: Path, resume_from: Path | None, rendezvous: str,
        bounds: Bounds,
    ) -> tuple[Path, subprocess.Popen, AttemptLimits | None] | None:
        """The attempt started from a warm interpreter, if it can be (workers/warm_pool.py): its
        inputs placed in the interpreter's slot, its spec written, and the launch command a cold
        start would run handed to it. `link`, the attempt's usual directory, points at the slot's."""
        if self.warm is None or (warm := self.warm.take(spec, bounds)) is None:
            return None
        inputs, run_dir = warm.inputs, warm.run_dir
        plugin = plugin_module(spec, self.settings) if spec.model.kind == "custom" else None
        try:
            if not place_inputs(warm, self.store.data_root(claimed), spec.data_paths, resume_from, plugin):
                warm.discard()
                return None
            (run_dir / SPEC_FILE_NAME).write_text(json.dumps(claimed.spec))
            prepare_attempt(run_dir, [])  # the spec is the job's user's to read
            command = launch_command(
                placed, run_dir, inputs / "data", inputs / "resume" if resume_from else None, rendezvous, claimed.node_rank,
                inputs / "plugins", resume_step=claimed.resume_step, skip_steps=claimed.skip_steps, cpu_threads=self.cpu_threads,
            )
            warm.hand_over(command[3:], training_environment(spec, run_dir, None))  # after `python -m accelerate.commands.launch`
        except OSError:  # it died meanwhile, or the inputs could not be placed: a cold start instead
            log.exception("job %s attempt %s could not start warm; starting it cold", claimed.job_id, claimed.number)
            warm.discard()
            return None
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(run_dir, target_is_directory=True)
        log.info("job %s attempt %s started from a warm interpreter in %s", claimed.job_id, claimed.number, warm.slot)
        return run_dir, warm.process, warm.limits

    def _wait_for_gang(self, claimed: ClaimedAttempt) -> Rendezvous | None:
        """Where our try's node 0 listens, once it has claimed its attempt (the other nodes of a
        gang start only then); in gang networks, once every node has (each one's filter names them
        all). Our lease is held meanwhile. None if that takes too long, or the gang ended."""
        deadline = time.monotonic() + self.node_0_wait_seconds
        while time.monotonic() < deadline:
            try:
                answer = self.service.rendezvous(claimed)
                if not answer.lease.held:
                    return None  # the gang ended meanwhile
                if answer.rendezvous is not None and (answer.gang is not None or not claimed.net_address):
                    return answer
            except ServiceUnreachable as exc:
                self._note_out_of_reach(claimed, exc)
            time.sleep(0.5)
        return None

    def _sync(self, claimed: ClaimedAttempt, outbox: Outbox, wait: bool = False, report: bool = True) -> Synced:
        """Renew the lease and deliver the outbox; no lease if the service is out of reach (everything is
        kept for next time). Checkpoints and outputs are taken into the store first; one still being
        taken in after INGEST_WAIT_SECONDS is registered by a later sync, unless this one `wait`s for it.
        `report` False: the API asked for the next report later than now (it is busy): the lease is
        renewed alone and metrics and lines wait for that report; checkpoints are registered all the same."""
        self._take_in(claimed, outbox, timeout=None if wait else INGEST_WAIT_SECONDS)
        # The steps a checkpoint covers are reported before it is listed: a resume starts after it.
        report = report or bool(outbox.checkpoints.taken or outbox.outputs.taken)
        try:
            # The lease first: however much there is to deliver, it is on time.
            lease, asked = self._renew(claimed, outbox, report)
        except ServiceUnreachable as exc:
            self._note_out_of_reach(claimed, exc)
            return Synced(None, 0.0)
        return Synced(lease, max(asked, self._deliver_or_keep(claimed, outbox, report)))

    def _renew(self, claimed: ClaimedAttempt, outbox: Outbox, report: bool) -> tuple[Lease, float]:
        """Renew the lease with the outbox's first report (its answer carries the lease), or in a
        request of its own when there is nothing to report, no report is due, or the report was
        refused; with how soon the API asked for the next report. A running job's host thus sends one
        request a heartbeat, not two, and a busy API still hears every renewal on time."""
        self._take_refused(outbox)
        if report and outbox.backlog():
            try:
                reported = self._report_batch(claimed, outbox, renew=True)
                return reported.lease, reported.next_report_seconds
            except (NotOurs, ServiceRefused) as exc:
                log.warning("could not deliver what job %s attempt %s reported (%s); will retry", claimed.job_id, claimed.number, exc)
        return self.service.renew(claimed), 0.0

    def _note_out_of_reach(self, claimed: ClaimedAttempt, exc: ServiceUnreachable) -> None:
        """Say so when the service goes out of reach, then once a minute while it stays so: a line per
        failed request (four a second, with a traceback each heartbeat) flooded the logs in an outage."""
        now = time.monotonic()
        if now - self.out_of_reach_noted.get(claimed.attempt_id, -math.inf) >= OUT_OF_REACH_NOTE_SECONDS:
            self.out_of_reach_noted[claimed.attempt_id] = now
            log.warning("job %s attempt %s: the service at %s is out of reach (%s); the training goes on, and what it reports is "
                        "kept and sent once the service answers", claimed.job_id, claimed.number, self.service.http.base_url, exc)

    def _forward(self, claimed: ClaimedAttempt, outbox: Outbox) -> float:
        """Deliver what is new without renewing the lease (between heartbeats); how soon the API
        asked for the next report."""
        self._take_in(claimed, outbox, timeout=0)
        return self._deliver_or_keep(claimed, outbox)

    def _deliver_or_keep(self, claimed: ClaimedAttempt, outbox: Outbox, report: bool = True) -> float:
        """Deliver the outbox; what the service did not take (out of reach, or refused: logged each
        time) stays in it for the next round, and the lease decides whether the attempt goes on.
        Returns how soon the API asked for the next report (0 if it did not answer)."""
        try:
            return self._deliver(claimed, outbox, report)
        except ServiceUnreachable as exc:
            self._note_out_of_reach(claimed, exc)
        except ServiceError as exc:
            log.warning("could not deliver what job %s attempt %s reported (%s); will retry", claimed.job_id, claimed.number, exc)
        return 0.0

    def _take_in(self, claimed: ClaimedAttempt, outbox: Outbox, timeout: float | None) -> None:
        outbox.checkpoints.take_in(self.ingest, partial(self.store.checkpoint, claimed), CorruptCheckpoint, timeout)
        outbox.outputs.take_in(self.ingest, partial(self._take_output, claimed), (OSError, CorruptCheckpoint), timeout)

    def _take_output(self, claimed: ClaimedAttempt, source: Path, name: str, step: int | None) -> tuple[str, str, int, int]:
        """An output copied out of the job's reach (no link followed, at most the attempt's disk
        limit: a sparse file is copied whole), then that copy handed to the store (moved in, or sent)."""
        folder = copy_out(self._run_dir(claimed), source, name, int(self.settings.max_attempt_disk_gb * 2**30))
        try:
            return self.store.output(claimed, folder, name, step)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # gone already if moved in

    def _deliver(self, claimed: ClaimedAttempt, outbox: Outbox, report: bool = True) -> float:
        """Send the outbox's metrics and lines in bounded reports for up to DELIVERY_SECONDS (what a
        report carried is taken out of it once answered; the rest waits for the next sync), then
        register its checkpoints and outputs taken into the store, and say what the store refused.
        `report` False: the checkpoints and outputs only. Returns how soon the API asked for the next report."""
        deadline = time.monotonic() + DELIVERY_SECONDS
        pause = 0.0
        self._take_refused(outbox)
        while True:
            if report and outbox.backlog():
                pause = self._report_batch(claimed, outbox).next_report_seconds
            self._register_checkpoints(claimed, outbox)
            self._register_outputs(claimed, outbox)
            if not (report and outbox.backlog()) or time.monotonic() >= deadline:
                return pause

    def _report_batch(self, claimed: ClaimedAttempt, outbox: Outbox, renew: bool = False) -> Reported:
        """Report the outbox's next batch of metrics, lines and refusals, taken out of it once answered."""
        points, lines, refused = outbox.metrics[:POINTS_PER_BATCH], outbox.next_lines(LINES_PER_BATCH), outbox.refused[:MAX_REFUSED_PER_REPORT]
        # Idempotent: sent again whole if its answer is lost (`resent` then, so no step is announced twice).
        resent, outbox.resending = outbox.resending, True
        reported = self.service.report(claimed, points, lines, refused, resent=resent, renew=renew)
        outbox.resending = False
        del outbox.metrics[:len(points)]
        outbox.drop_lines(len(lines))
        del outbox.refused[:len(refused)]
        return reported

    def _register_checkpoints(self, claimed: ClaimedAttempt, outbox: Outbox) -> None:
        """Register the checkpoints taken into the store (the service drops the oldest past `keep_last`)."""
        def register(source: Path, step: int, _folder: str, taken: tuple[str, str, int]) -> None:
            relative, sha256, size = taken
            self.service.checkpoint_stored(claimed, step, relative, sha256, size)
            shutil.rmtree(source, ignore_errors=True)  # the store has it now (moved, or copied: the loop leaves it to us)

        outbox.checkpoints.record(register)

    def _register_outputs(self, claimed: ClaimedAttempt, outbox: Outbox) -> None:
        """Register the script's outputs copied into the store, each replacing its name's earlier copy."""
        outbox.outputs.record(lambda _source, name, step, taken: self.service.output_stored(claimed, name, step, *taken))

    def _take_refused(self, outbox: Outbox) -> None:
        """Move what the store refused into the outbox, as events of the job for the next report and
        a line each in its logs: never dropped silently."""
        kinds = (  # (the transfers, its event, its noun, (step, what) of one of its items)
            (outbox.checkpoints, JobEventType.checkpoint_refused, "checkpoint", lambda _source, step, folder: (step, folder)),
            (outbox.outputs, JobEventType.output_refused, "output", lambda _source, name, step: (step, name)),
        )
        for transfers, kind, noun, describe in kinds:
            while transfers.refused:
                item, reason = transfers.refused.pop(0)
                step, what = describe(*item)
                outbox.refused.append(RefusedTransfer(kind=kind.value, step=step, what=what[:MAX_WHAT_CHARS], reason=reason[:MAX_LINE_CHARS]))
                outbox.add_line(None, f"trainyard: {noun} {what!r} (step {step}) refused by the artifact store, not stored: {reason}")

    def _finish(self, claimed: ClaimedAttempt, outcome: AttemptStatus | None, reason: str | None) -> None:
        if outcome is None:
            log.warning("job %s attempt %s: %s", claimed.job_id, claimed.number, reason)
            return
        # The outcome must reach the service: retry until it does or our lease is gone. Past a lease
        # of silence the service takes the attempt for lost and runs the job again from its last
        # checkpoint: retrying longer only kept a stopping worker up for ever (a traceback every 2 s).
        while True:
            try:
                rollback = Rollback(**reason.spike.model_dump(exclude={"type"}), drop=reason.drop) if isinstance(reason, RollbackReason) else None
                ended = self.service.finish(claimed, outcome, reason, retry=not isinstance(reason, FinalReason), rollback=rollback)
                log.info("job %s attempt %s %s%s", claimed.job_id, claimed.number, outcome.value, "" if ended else " (too late: lease lost)")
                return
            except ServiceUnreachable as exc:
                if self.service.silent_for() > self.settings.lease_seconds:
                    log.warning("job %s attempt %s %s, but the service has been out of reach for longer than its lease (%s): "
                                "it takes the attempt for lost, and runs the job again from its last checkpoint",
                                claimed.job_id, claimed.number, outcome.value, exc)
                    return
                self._note_out_of_reach(claimed, exc)
                time.sleep(2)
            except ServiceError:  # refused: its lease runs out, and the attempt ends lost (and is retried)
                log.exception("the service refused the end of job %s attempt %s", claimed.job_id, claimed.number)
                return


class RunningAttempt:
    """An attempt's processes, watched until they are done and all they produced is delivered.
    Each round of `supervise` takes what they wrote, kills them if they stalled, syncs with the
    database every heartbeat, and waits for more output."""

    def __init__(
        self, runner: AttemptRunner, claimed: ClaimedAttempt, spec: JobSpec, run_dir: Path, process: subprocess.Popen,
        limits: AttemptLimits | None = None, outbox: Outbox | None = None,
    ):
        self.runner, self.claimed, self.spec, self.run_dir, self.process = runner, claimed, spec, run_dir, process
        self.limits = limits
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output = threading.Event()  # set by the pump on each line and when the output ends
        threading.Thread(target=_pump_lines, args=(process.stdout, self.lines, self.output), daemon=True).start()
        self.events = EventTail(run_dir / EVENTS_FILE_NAME)
        self.outbox = outbox or Outbox()  # with what the attempt logged before its processes started
        self.checkpoint_numbers = itertools.count(1)
        # For the failure reason: enough to hold the launcher's traceback and the user's error above it.
        self.recent_lines: deque[str] = deque(maxlen=4 * REASON_LOG_LINES)
        self.dropped = DroppedLines(runner.settings.max_log_lines_per_attempt)
        self.invalid_spec: str | None = None  # what the training said is wrong with the spec, if it did
        self.spike: SpikeEvent | None = None  # what the loss guard saw, if it stopped the run
        # A script or custom loop is guarded from here, by what it logs; the built-in loop guards itself (and skips the data).
        watched = spec.script is not None or getattr(spec.model, "kind", None) == "custom"
        self.loss_watch = LoggedLossWatch(spec.training.guard) if watched else None
        # What a script or custom loop logged and checkpointed: its checkpoint.keep_best metric is its own to log.
        self.logged: set[str] | None = set() if watched else None
        self.checkpoints_taken = 0
        self.noted: set[str] = set()  # what the job's logs were told the service can't keep
        self.started_at = time.monotonic()
        self.max_runtime_s = (spec.resources.max_runtime_hours or runner.settings.max_runtime_hours) * 3600
        self.over_limit: str | None = None  # why it was stopped for running too long or writing too much, once it was
        disk_gb = spec.resources.disk_gb or runner.settings.max_attempt_disk_gb
        every = min(runner.settings.heartbeat_seconds, DISK_WATCH_SECONDS)
        self.disk = DiskWatch(run_dir, int(disk_gb * 2**30), every, skip=frozenset({INPUT_COPIES}))
        self.stall = StallWatch(spec.training.stall_timeout_s)
        self.outputs_collected_at_end = False
        self.stalled = False
        self.exit_code: int | None = None  # as of this round's start
        self.output_done = False
        self.preempted_because: str | None = None  # set once we asked the training to stop at a checkpoint
        self.next_sync = 0.0
        self.synced = False  # the first sync comes at once, the second anywhere within a heartbeat (heartbeat_pause)
        self.next_forward = self.forwarded_at = 0.0
        self.renewed_at = time.monotonic()  # the lease's last renewal
        self.step = claimed.resume_step or 0  # the last step the training reported: where system samples are put
        self.last_step_at: float | None = None  # when the training reported its last step (training.max_steps)
        self.system = SystemSampler(process.pid, claimed.device_ids)

    @property
    def finished(self) -> bool:
        """The processes have exited and all their output is read."""
        return self.exit_code is not None and self.output_done

    def supervise(self) -> Outcome:
        try:
            return self._supervise()
        finally:
            self.disk.stop()

    def _supervise(self) -> Outcome:
        while True:
            self.exit_code = self.process.poll()
            if self.runner.shutting_down.is_set():
                self._preempt(self.host_shut_down)
            self.output.clear()  # a line from here on wakes the next wait
            self._take_output()
            self._take_events()
            self._kill_if_stalled()
            self._stop_if_over_limits()
            self._collect_outputs_at_end()
            self._note_unranked_best()
            if (ended := self._sync_if_due()) is not None:
                return ended
            if self.finished and self.outbox.empty():
                return self._outcome()
            if self.finished and self._stopping_unheard():
                return None, (f"the host stopped while the service was out of reach for longer than the lease "
                              f"({self.runner.settings.lease_seconds:g} s): it takes the attempt for lost and runs the job again from "
                              "its last listed checkpoint; what the attempt reported since is not delivered")
            self._wait()

    def _stopping_unheard(self) -> bool:
        """The host is stopping and the service has not answered for longer than a lease: the attempt
        is lost to it, and what is left to deliver never will be (a stopping worker waited for ever)."""
        return self.runner.shutting_down.is_set() and self.runner.service.silent_for() > self.runner.settings.lease_seconds

    def _take_output(self) -> None:
        """Move the lines the processes printed since the last round into the outbox."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            if line is None:
                self.output_done = True
                for note in self.dropped.resumed():
                    self._note(note)
                self._note_cpu_held_back()
                return
            rank, line = split_rank(line, self.claimed.node_rank, self.spec)
            line = final_state(line)  # after the rank's prefix, which only the line's start has
            self.recent_lines.append(line[:MAX_LOG_LINE])  # the failure reason's, kept or not
            keep, notes = self.dropped.take(self.outbox.log_chars)
            for note in notes:
                self._note(note)
            if keep:
                self.outbox.add_line(rank, line)

    def _note_cpu_held_back(self) -> None:
        # A job slower than its owner expects says why: it starts more busy threads than its slots have cores.
        if self.limits is not None and (share := self.limits.throttled()) >= CPU_HELD_BACK_NOTED:
            self._note(f"trainyard: the job's processes wanted more than their {self.limits.bounds.cpu_cores} core(s) and were held "
                       f"back in {share:.0%} of the time they ran (the CPU its slots hold on {self.runner.host_name})")

    def _note(self, line: str) -> None:
        """A line of the worker's own in the job's logs."""
        self.outbox.add_line(None, line)

    def _take_events(self) -> None:
        """Move the metrics and checkpoints the training reported since the last round into the outbox."""
        events = self.events.read()
        if self.events.skipped:
            self._note_once("not-events", "trainyard: lines of the job's events file that are no event were skipped (the file is Trainyard's: write metrics with accelerator.log)")
        for event in events:
            if isinstance(event, InvalidSpecEvent):
                self.invalid_spec = event.message
                continue
            if isinstance(event, SpikeEvent):
                self.spike = event
                continue
            self.stall.progressed()  # a script that never calls accelerator.log shows its progress by its checkpoints
            if not self._recordable_step(event):
                continue
            self.step = max(self.step, event.step)
            if self.last_step_at is None and self.step == self.spec.training.max_steps:
                self.last_step_at = time.monotonic()
            if isinstance(event, MetricsEvent):
                self.outbox.metrics += [(event.step, name, value) for name, value in event.values.items() if self._recordable_name(name)]
                if self.logged is not None:
                    self.logged.update(event.values)
                if self.loss_watch is not None and (spike := self.loss_watch.metrics(event.step, event.values)):
                    self._roll_back(spike)
            # The worker deletes a checkpoint once stored: it takes none from outside the attempt, and
            # moves it out of the job's reach before anything else (workers/job_paths.py).
            elif (handed := self._take_checkpoint(event.path)) is not None:
                folder = self._store_folder(event.step, event.path)
                self.outbox.checkpoints.items.append((handed, event.step, folder))
                self.checkpoints_taken += 1
                if self.loss_watch is not None:
                    self.loss_watch.checkpoint(folder)
                if self.spec.script is not None and self.spec.script.outputs_at_checkpoints:
                    self._collect_outputs()

    def _take_checkpoint(self, path: Path) -> Path | None:
        """The checkpoint directory moved out of the job's reach; None (the job's logs say why) if
        it is not a directory of the attempt's reached without a link."""
        try:
            return take_out(self.run_dir, path)
        except NotTheJobs as exc:
            log.warning("job %s: checkpoint not stored: %s", self.claimed.job_id, exc)
            self.outbox.add_line(None, f"trainyard: checkpoint not stored: {exc}")
            return None

    def _roll_back(self, spike: Spike) -> None:
        """The watched loop's loss spiked: kill it (what it would save now is suspect); the job goes on
        from the checkpoint it wrote before the spike began, those after it dropped (`loss_watch.dropped`
        for a script; a custom loop's by their steps, and it is told to skip the spike's batches)."""
        self.spike = SpikeEvent(first_step=spike.first_step, last_step=spike.last_step, reason=spike.reason)
        self._note(f"trainyard: loss guard: {spike.reason}; stopping, to go on from its checkpoint saved before step "
                   f"{spike.first_step} (while rollbacks are left: training.guard)")
        if self.exit_code is None:
            _stop(self.process, grace_seconds=0)

    # The events file is the job's to write: what the service can't keep is left out here, saying so
    # once in the job's logs, rather than sent and refused again and again, holding up all after it.

    def _recordable_step(self, event: MetricsEvent | CheckpointEvent) -> bool:
        low = 0 if isinstance(event, CheckpointEvent) else INT32_MIN
        if low <= event.step <= INT32_MAX:
            return True
        self._note_once(f"step {event.step}", f"trainyard: step {event.step} is outside what the service keeps ({low} to {INT32_MAX}); its {event.type} not recorded")
        return False

    def _recordable_name(self, name: str) -> bool:
        if len(name) > MAX_METRIC_NAME_CHARS:
            self._note_once(f"name {name}", f"trainyard: metric {name[:80]!r}… has a name longer than {MAX_METRIC_NAME_CHARS} characters; not recorded")
            return False
        if not name.isprintable():  # a NUL: PostgreSQL refuses it, and the whole report with it, every time it is sent
            self._note_once(f"name {name}", f"trainyard: metric {name!r} has a control character in its name; not recorded")
            return False
        return True

    def _note_unranked_best(self) -> None:
        """Said once its processes have ended: a script or custom loop that checkpointed but never
        logged the metric its checkpoint.keep_best ranks by has no checkpoint kept as its best, and
        nothing else would tell its owner why."""
        if self.finished and self.logged is not None and self.checkpoints_taken:
            if note := unranked_best_note(self.spec.checkpoint, self.logged):
                self._note_once("unranked best", note)

    def _note_once(self, key: str, line: str) -> None:
        if key not in self.noted:
            self.noted.add(key)
            self._note(line)

    def _store_folder(self, step: int, path: Path) -> str:
        """Where a checkpoint goes in the store, under the job's checkpoints. A script's keeps the
        folder name it was saved under, inside a folder of its own: two saves with one name or one
        step are two checkpoints, and a resume gets the name the script parses (`…/step_1200`)."""
        if self.spec.script is None:
            return checkpoint_name(step)
        return f"attempt-{self.claimed.number}.{next(self.checkpoint_numbers)}/{path.name}"

    def _collect_outputs_at_end(self) -> None:
        if self.finished and self.exit_code == 0 and not self.outputs_collected_at_end:
            self.outputs_collected_at_end = True
            self._collect_outputs()

    def _collect_outputs(self) -> None:
        """Queue the script's `outputs` to be copied into the store as they are now (node 0's only:
        the nodes of a job share its outputs' names). One that is missing, or reaches outside the
        working directory through a symbolic link, is skipped, and the job's logs say so."""
        if self.spec.script is None or self.claimed.node_rank != 0:
            return
        cwd = working_dir(self.spec, self.run_dir)
        for name in self.spec.script.outputs:
            source = cwd / name  # copied out without following a link (AttemptRunner._take_output)
            if source.is_dir() and not source.is_symlink():
                self.outbox.outputs.items.append((source, name, self.step))
            else:
                why = "a symbolic link" if source.exists() else "no such directory"
                line = f"trainyard: output {name!r} not collected: {why} in the working directory"
                self.outbox.add_line(None, line)

    def _kill_if_stalled(self) -> None:
        # A hung rank (a dead collective peer, a stuck read) keeps the lease alive through us, so
        # nothing else would ever notice. It won't answer SIGTERM: kill the group.
        if self.exit_code is None and not self.stalled and self.stall.expired():
            log.warning("job %s attempt %s: %s", self.claimed.job_id, self.claimed.number, self.stall.reason)
            _stop(self.process, grace_seconds=0)
            self.stalled = True

    def _stop_if_over_limits(self) -> None:
        # Bounded by default: a job that never ends (a loop without max_steps, a hung script that
        # still prints) would hold its devices for ever, and one that writes without end fill the host's disk.
        if self.exit_code is not None or self.over_limit is not None:
            return
        if time.monotonic() - self.started_at > self.max_runtime_s:
            hours = self.max_runtime_s / 3600
            self.over_limit = f"max runtime: ran {hours:g} h (resources.max_runtime_hours, or the service's TRAINYARD_MAX_RUNTIME_HOURS)"
        elif self.disk.over():
            self.over_limit = (
                f"disk limit: its directory on {self.runner.host_name} held {self.disk.used / 2**30:.2f} GB, over its "
                f"{self.disk.limit_bytes / 2**30:g} GB (resources.disk_gb, or the service's TRAINYARD_MAX_ATTEMPT_DISK_GB)"
            )
        if self.over_limit is not None:
            log.warning("job %s attempt %s: %s; stopping it", self.claimed.job_id, self.claimed.number, self.over_limit)
            _stop(self.process)

    def _sync_if_due(self) -> Outcome | None:
        """Every heartbeat, and every round once the processes are done: renew the lease and deliver
        the outbox. An outcome if the lease says the attempt ends now. Between heartbeats, forward
        what is new (at most every FORWARD_SECONDS, less often if the API is slow: forward_pause, or
        asks for fewer reports); a sync's report counts as a forward."""
        started, heartbeat = time.monotonic(), self.runner.settings.heartbeat_seconds
        report = self.finished or started >= self.next_forward
        if not (self.finished or started >= self.next_sync):
            # Paced to a heartbeat or more, reports go with the heartbeats, each renewing the lease;
            # a checkpoint goes at once all the same (a resume can start only from one listed).
            checkpoint = self.outbox.checkpoints.ready() or self.outbox.outputs.ready()
            if checkpoint or (report and not self.outbox.empty() and self.next_forward - self.forwarded_at < heartbeat):
                asked = self.runner._forward(self.claimed, self.outbox)
                self._note_forward(started, asked)
            return None
        self.next_sync = started + heartbeat_pause(heartbeat, first=not self.synced)
        self.synced = True
        if self.exit_code is None:
            self.outbox.metrics += self.system.sample(self.step)
        waiting = self.outbox.waiting()
        lease, asked = self.runner._sync(self.claimed, self.outbox, report=report)
        if report:
            self._note_forward(started, asked)
        if report and lease is not None and self.outbox.backlog() and self.outbox.waiting() < waiting:
            self.next_sync = 0.0  # what is left of a burst goes on at the next round
        if lease is None:  # the database is out of reach: all is kept for the next sync
            return None
        if (gap := time.monotonic() - self.renewed_at) > self.runner.settings.lease_seconds / 2:
            # Say so before the lease is lost: the host is starved, or the database slow to answer.
            log.warning("job %s attempt %s: the lease was renewed %.1f s after the last time (lease %g s)",
                        self.claimed.job_id, self.claimed.number, gap, self.runner.settings.lease_seconds)
        self.renewed_at = time.monotonic()
        if not lease.held:
            _stop(self.process)
            return None, "lease lost"
        # A rank that failed after the cancel failed because of it: in a gang, the ranks of
        # another node stopped first and took this node's collectives down with them.
        if lease.cancel_requested and not (self.finished and self.exit_code == 0) and not self.finishing:
            _stop(self.process)
            self.runner._sync(self.claimed, self.outbox, wait=True)
            return AttemptStatus.cancelled, "cancelled by user"
        if lease.preempt_requested and not self.finishing:
            full = self.spec.resources.processes_per_node
            # An elastic job placed smaller is stopped to go back to its size (or, preemptible, for a higher priority).
            why = f"stopped to go back to its full size of {full} processes" if self.claimed.slots < full else "preempted for a higher-priority job"
            self._preempt(lease.preempt_reason or why)
        return None

    @property
    def finishing(self) -> bool:
        """The training reported its last step: all it has left is its last checkpoint and its exit.
        A cancel or a preemption (a sweep's pruning) that comes now would throw a finished run away
        (seen: a job cancelled at 2000/2000, a trial pruned at 60/60, each stopped as it wrote its
        last checkpoint), so it is let finish, for FINISHING_GRACE_SECONDS at most."""
        return self.last_step_at is not None and time.monotonic() - self.last_step_at < FINISHING_GRACE_SECONDS

    def _note_forward(self, started: float, asked: float) -> None:
        """When the next report is due: as the API asked, or later if it was slow to answer (forward_pause)."""
        self.forwarded_at, self.next_forward = started, started + max(asked, forward_pause(time.monotonic() - started))

    @property
    def host_shut_down(self) -> str:
        """Why the training was asked to stop, when the host's own stop asked it."""
        return f"host {self.runner.host_name} shut down"

    def _preempt(self, reason: str) -> None:
        """Ask the running training to stop: it answers SIGTERM with a checkpoint at the next step, then exits."""
        if self.preempted_because is None and self.exit_code is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.preempted_because = reason

    def _wait(self) -> None:
        if self.finished:
            # Only the outbox left to deliver. The last sync stored part of a backlog: the rest goes
            # after the pause a running attempt's rounds take (a second's pause halved a flood's pace),
            # which leaves the API to other hosts' requests a while; else (the service took none) retry it.
            time.sleep(FORWARD_SECONDS if self.next_sync == 0.0 else 1.0)
            return
        # Until the training writes a line or its output ends, at most FORWARD_SECONDS (its events
        # file wakes nothing: a step's metrics wait for this), at least a tenth of a second: this
        # process shares the cores with the training, and each wake-up is taken from it.
        woke = time.monotonic()
        self.output.wait(0.1 if self.output_done else FORWARD_SECONDS)
        time.sleep(max(0.0, woke + 0.1 - time.monotonic()))

    def _outcome(self) -> Outcome:
        # The loss guard stopped the run (every node's processes alike): whatever code the launcher
        # passed on; a watched loop that ended before it was stopped ended diverged, its last checkpoint too.
        if self.spike is not None:
            reason = RollbackReason(f"loss guard: {self.spike.reason}")
            reason.spike = self.spike
            if self.spec.script is not None:  # its own numbering: by the order it wrote them (a custom loop's are steps)
                reason.drop = [f"jobs/{self.claimed.job_id}/checkpoints/{folder}" for folder in self.loss_watch.dropped]
            return AttemptStatus.preempted, reason
        if self.exit_code == 0 and (refused := self.outbox.checkpoints.last_refused):
            # Its work would be lost with it: no resume, no download of the end of the run. The job's own
            # code made it so, and would again: not retried.
            return AttemptStatus.failed, FinalReason(f"its last checkpoint was refused by the artifact store: {refused}")
        if self.exit_code == 0:
            return AttemptStatus.succeeded, None
        if self.stalled:
            return AttemptStatus.failed, self.stall.reason
        if self.over_limit is not None:
            return AttemptStatus.failed, FinalReason(self.over_limit)
        if self.limits is not None and self.limits.oom_kills():
            return AttemptStatus.failed, f"out of memory: the job {self._memory_limit()}, and the kernel killed a process of it"
        # Accelerate's launcher turns any failed child into exit code 1 (and dies on SIGTERM
        # itself), so what counts is that the stop was asked for, not the code we got back: by us,
        # or by whoever sent SIGTERM to the host's processes, ours and the training's at once (a
        # cluster preempting its job: workers/slurm_agent.py).
        # Asked whether the host's stop was for good (a cluster's cancel) whether or not this loop saw
        # the stop before the training ended: on a loaded node it sees it first, and asks the training
        # to stop for the host's reason; only a stop the service asked for (a preemption) is not asked.
        stopped_by_host = self.runner.shutting_down.is_set() and self.preempted_because in (None, self.host_shut_down)
        if stopped_by_host and (why := self.runner.stopped_for_good()):
            return AttemptStatus.failed, f"{why}; stopped at a checkpoint"  # tried again while restarts remain
        if self.preempted_because or self.exit_code == EXIT_PREEMPTED or self.runner.shutting_down.is_set():
            return AttemptStatus.preempted, f"{self.preempted_because or 'SIGTERM'}; stopped at a checkpoint"
        if self.invalid_spec is not None:
            return AttemptStatus.failed, FinalReason(f"invalid job spec: {self.invalid_spec}")
        tail = "\n".join(without_launcher_traceback(list(self.recent_lines))[-REASON_LOG_LINES:])
        return AttemptStatus.failed, f"training process exited with code {self.exit_code}; last output:\n{tail}"

    def _memory_limit(self) -> str:
        if (asked := self.spec.resources.memory_gb) is not None:
            return f"went over its limit of {asked:g} GB (resources.memory_gb)"
        if (share := self.limits.bounds.memory_bytes) is not None:
            return (f"went over its {share / 2**30:.1f} GB, its slots' share of host {self.runner.host_name} "
                    "(resources.memory_gb asks for a limit of its own)")
        return "ran out of memory"


def unranked_best_note(policy: CheckpointConfig, logged: set[str]) -> str | None:
    """The job log's line when `policy` keeps the best checkpoint by a metric not among those `logged`."""
    if not policy.keep_best or policy.best_metric in logged:
        return None
    names = ", ".join(sorted(logged)[:10]) + (", …" if len(logged) > 10 else "") if logged else "none"
    return (f"trainyard: checkpoint.keep_best ranks checkpoints by {policy.best_metric!r}, which this attempt never logged: "
            f"no checkpoint is kept as its best (checkpoint.best_metric; it logged: {names})")


# How the launcher's own traceback ends: Accelerate's, over one failed process, and torchelastic's
# (followed by its table of the failed ranks), over several.
LAUNCHER_ERRORS = ("subprocess.CalledProcessError:", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")


def without_launcher_traceback(lines: list[str]) -> list[str]:
    """The output's last lines without the launcher's own traceback at their end: it said nothing
    the user's own error above it hadn't, and buried it (of several processes, torchelastic's
    traceback and table of failed ranks took all of a failure reason's lines, and the
    `RuntimeError` itself was not among them). The launcher's lines are the unprefixed ones."""
    ends = [i for i, line in enumerate(lines) if line.startswith(LAUNCHER_ERRORS)]
    starts = [i for i, line in enumerate(lines[:ends[-1]]) if line.startswith("Traceback (most recent call last):")] if ends else []
    return lines[: starts[-1]] if starts and starts[-1] > 0 else lines


def final_state(line: str) -> str:
    """What a terminal would show of a line that redraws itself with carriage returns (a tqdm
    progress bar): the text after its last `\r` that has any."""
    return next((part for part in reversed(line.split("\r")) if part.strip()), "")


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
