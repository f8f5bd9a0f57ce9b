"""Warm interpreters a worker host keeps ready (workers/warm.py): an attempt that can use one
starts without paying for Python, torch and accelerate to load (most of a cold start's seconds).

Each is started before its attempt is known, in a sandbox of its own made as a cold start's is
(workers/sandbox.py: the same system view, user, namespaces and cgroup), around a slot directory:
  - `run/`, writable: becomes the attempt's directory (its spec, events, checkpoints); the attempt's
    usual path (work/job-N/attempt-M) is a link to it;
  - `inputs/`, read-only inside: once the attempt is known the worker places its inputs there
    (dataset, tokenizer, model directory, custom module, the checkpoint it resumes from), each
    hard-linked where the job's user may read it and the filesystem allows, else copied.
The attempt's memory limit is written into the interpreter's cgroup when it is handed over, and
its priority, lowered while it loaded beside running jobs, is raised back.

Which attempts start warm (`WarmPool.take`): those of jobs that may (JobSpec.may_start_warm: the
built-in and custom loops, on one node, on the CPU, in the worker's own Python), with a memory limit
only where a cgroup can apply it after the start, and at most WARM_COPY_LIMIT bytes of inputs to
copy. The others, and any attempt that finds no warm interpreter ready, start cold as before.
A Slurm node's agent (workers/slurm_agent.py) starts one as it starts, when its try may use it: it
loads while the attempt is claimed and its inputs placed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from api_schemas import JobSpec
from common.settings import Settings
from workers.launch import SERVICE_SETTINGS_PREFIX
from workers.limits import AttemptLimits, Bounds, limited
from workers.sandbox import (
    MAX_OPEN_FILES, MAX_PROCESSES, SANDBOX_GID, SANDBOX_UID, AttemptView, HostSandbox, prepare_attempt, sandbox_command, service_state,
)

log = logging.getLogger("trainyard.worker")

WARM_COPY_LIMIT = 256 * 2**20  # inputs that can't be linked, copied at hand-over; past it a cold start binds them instead
CLOSE_WAIT_SECONDS = 60.0  # how long closing waits for an interpreter still starting (an import of torch)
LOADING_NICENESS = 19  # while it loads, a new interpreter takes only the cores running jobs leave idle


@dataclass
class WarmInterpreter:
    slot: Path
    process: subprocess.Popen
    limits: AttemptLimits | None
    niced: bool
    env: dict[str, str] = field(default_factory=dict)  # what it was started with (the sandbox adds its own)

    def hand_over(self, command: list[str], env: dict[str, str]) -> None:
        """Start the attempt: `command`, what follows `python -m accelerate.commands.launch` in a
        cold start's command line, with the processes' environment `env`. Only the variables that
        differ from its own start's are sent: the sandbox's (HOME, TMPDIR, the loopback interface)
        stay as a cold start's sandbox sets them."""
        changed = {name: value for name, value in env.items() if self.env.get(name) != value}
        unset = [name for name in self.env if name not in env]
        self.process.stdin.write(json.dumps({"command": command, "env": changed, "unset": unset}).encode() + b"\n")
        self.process.stdin.close()

    @property
    def run_dir(self) -> Path:
        return self.slot / "run"

    @property
    def inputs(self) -> Path:
        return self.slot / "inputs"

    def alive(self) -> bool:
        return self.process.poll() is None

    def discard(self) -> None:
        """Let it go unused: killed, with all it started. It ran nothing of a job's; asked to exit (its
        stdin closed), one still importing torch at low priority heard it only once loaded, and a
        worker's stop waited up to 5 s for it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        if self.limits is not None:
            self.limits.remove()
        shutil.rmtree(self.slot, ignore_errors=True)


class WarmPool:
    """Up to `size` warm interpreters, each used once and replaced in the background once its
    attempt has ended (`fill`): loading beside a starting attempt on the CPU would take cores from
    its threads, which wait for each other at every operation (a 5-step job ran 7 times slower)."""

    def __init__(self, settings: Settings, sandbox: HostSandbox, size: int):
        self.settings, self.sandbox, self.size = settings, sandbox, size
        self.root = settings.resolved_work_root / "warm"
        self.ready: list[WarmInterpreter] = []
        self.starting = 0  # being started by `fill`, not ready yet
        self.lock = threading.Lock()
        self.closed = False

    def fill(self) -> None:
        """Start interpreters up to the pool's size, on a thread of their own."""
        threading.Thread(target=self._fill, name="warm-pool", daemon=True).start()

    def take(self, spec: JobSpec, bounds: Bounds) -> WarmInterpreter | None:
        """A warm interpreter for an attempt of `spec`, bounded by `bounds`, if it can start warm and one is ready."""
        if not self._fits(spec, bounds):
            return None
        warm = None
        with self.lock:
            while self.ready and warm is None:
                candidate = self.ready.pop(0)
                if candidate.alive():
                    warm = candidate
                else:  # died while waiting (killed, out of memory): replaced once the attempt ends
                    candidate.discard()
        if warm is None:
            return None
        if warm.limits is not None:
            try:
                warm.limits.bound(bounds)
            except OSError:  # it already holds more than the limit: a cold start fails on its own terms
                warm.discard()
                return None
        if warm.niced:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PGRP, warm.process.pid, 0)
        return warm

    def close(self) -> None:
        with self.lock:
            self.closed = True
            ready, self.ready = self.ready, []
        for warm in ready:
            warm.discard()
        # One still starting is discarded by its own thread once started: wait for that, so that a
        # process exiting now (a Slurm agent, after its one attempt) leaves no slot behind.
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        while self.starting and time.monotonic() < deadline:
            time.sleep(0.1)

    def _fits(self, spec: JobSpec, bounds: Bounds) -> bool:
        # A limit it can't take on once started (no cgroups: a cold start's rlimit) keeps it cold.
        return self.size > 0 and spec.may_start_warm and (bounds.memory_bytes is None or self.sandbox.limits is not None)

    def _fill(self) -> None:
        while self._reserve():
            try:
                warm = self._start()
            except OSError:
                log.exception("could not start a warm interpreter; attempts start cold")
                with self.lock:
                    self.starting -= 1
                return
            with self.lock:
                self.starting -= 1
                if not self.closed:
                    self.ready.append(warm)
                    continue
            warm.discard()
            return

    def _reserve(self) -> bool:
        """Count one more interpreter as starting, if the pool wants one: two attempts ending at
        once ask twice, and each start costs an import of torch."""
        with self.lock:
            if self.closed or len(self.ready) + self.starting >= self.size:
                return False
            self.starting += 1
            return True

    def _start(self) -> WarmInterpreter:
        slot = self.root / uuid.uuid4().hex
        run_dir, inputs = slot / "run", slot / "inputs"
        run_dir.mkdir(parents=True)
        _readable_dir(inputs)
        command = [sys.executable, "-m", "workers.warm", f"{run_dir}/"]
        if self.sandbox.enabled:
            prepare_attempt(run_dir, [])
            view = AttemptView(run_dir, ((inputs, inputs),), service_state(self.settings), host_network=False)
            command = sandbox_command(command, run_dir, view, self.sandbox.tool)
        limits = None
        if self.sandbox.limits:
            limits = AttemptLimits.create(f"trainyard-warm-{slot.name}", Bounds(), MAX_PROCESSES)
        niced = os.geteuid() == 0  # only root can raise it back at hand-over
        if niced:
            command = ["nice", "-n", str(LOADING_NICENESS), *command]
        env = {name: value for name, value in os.environ.items() if not name.startswith(SERVICE_SETTINGS_PREFIX)}
        env["PYTHONUNBUFFERED"] = "1"
        process = subprocess.Popen(
            limited(command, MAX_OPEN_FILES, limits, None), cwd=run_dir, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        return WarmInterpreter(slot, process, limits, niced, env)


def place_inputs(warm: WarmInterpreter, data_root: Path, data_inputs: list[str], resume_from: Path | None, plugin: Path | None) -> bool:
    """Put an attempt's inputs where its warm interpreter reads them: the data files at their paths
    under `inputs/data` (the attempt's data root), the checkpoint as `inputs/resume`, the custom
    module under `inputs/plugins`. False, with nothing placed, if more than WARM_COPY_LIMIT bytes
    would have to be copied."""
    placements = [(data_root / relative, warm.inputs / "data" / relative) for relative in data_inputs if (data_root / relative).exists()]
    if resume_from is not None:
        placements.append((resume_from, warm.inputs / "resume"))
    if plugin is not None and plugin.exists():
        placements.append((plugin, warm.inputs / "plugins" / plugin.name))
    files = [(source, target) for path, place in placements for source, target in _files(path.resolve(), place)]
    device = warm.inputs.stat().st_dev
    copies = [(source, target) for source, target in files if not _linkable(source, device)]
    if sum(source.stat().st_size for source, _ in copies) > WARM_COPY_LIMIT:
        return False
    for source, target in files:
        for directory in reversed(target.relative_to(warm.inputs).parents[:-1]):
            _readable_dir(warm.inputs / directory)
        if (source, target) in copies:
            shutil.copyfile(source, target)
            if os.geteuid() == 0:
                os.chown(target, SANDBOX_UID, SANDBOX_GID)  # a copy is the job's own; a link stays the store's
        else:
            os.link(source, target)
    return True


def _readable_dir(path: Path) -> None:
    """A directory the job's user may enter and list (the worker's umask may keep it private)."""
    path.mkdir(exist_ok=True)
    path.chmod(0o755)


def _files(source: Path, target: Path) -> list[tuple[Path, Path]]:
    if source.is_file():
        return [(source, target)]
    return [(path, target / path.relative_to(source)) for path in sorted(source.rglob("*")) if path.is_file()]


def _linkable(path: Path, device: int) -> bool:
    """A hard link shares the file itself: only one any user may read, on the slot's filesystem.
    Inside, the slot's `inputs` is a read-only mount, so the job can't write through it."""
    status = path.stat()
    return status.st_dev == device and bool(status.st_mode & 0o004)
