"""An attempt's memory and process-count limits, as a control group of its own.

Why a cgroup and not rlimits: RLIMIT_AS counts address space, and PyTorch (CUDA above all) reserves
far more of it than it ever touches, so any useful value breaks healthy jobs; RLIMIT_NPROC counts per
user id, and every sandboxed attempt shares one. A cgroup's memory limit counts the pages really
used, by all of the attempt's processes together, and the kernel kills inside the group only (the
worker lives on) and counts the kills, so the outcome can say why. Works on cgroup v2 (memory.max,
pids.max, memory.events) and on v1 hierarchies (memory.limit_in_bytes, memory.oom_control, pids.max),
beside the cgroup the worker runs in; where none is writable, `available()` says so and the host
shows it (GET /v1/workers).
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_group(controller: str) -> Path | None:
    """This process's cgroup directory that holds `controller` (v2: the unified one), if writable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():  # pure v2
            # The attempt's group is a child of ours: it has the controller if ours hands it down.
            directory = CGROUP_ROOT / path.lstrip("/")
            if controller in (directory / "cgroup.subtree_control").read_text().split():
                return directory if os.access(directory, os.W_OK) else None
        elif controller in controllers.split(","):
            directory = CGROUP_ROOT / controller / path.lstrip("/")
            return directory if os.access(directory, os.W_OK) else None
    return None


def available() -> str | None:
    """How limits are enforced here (for the host's description), or None if they can't be."""
    memory, pids = _own_group("memory"), _own_group("pids")
    if memory is None or pids is None:
        return None
    return "cgroup v2" if (memory / "cgroup.controllers").exists() else "cgroup v1"


@dataclass
class AttemptLimits:
    """One attempt's cgroups (one per controller on v1, the same directory twice on v2)."""

    memory_dir: Path
    pids_dir: Path
    memory_bytes: int | None

    @classmethod
    def create(cls, name: str, memory_bytes: int | None, max_processes: int) -> AttemptLimits:
        memory_parent, pids_parent = _own_group("memory"), _own_group("pids")
        if memory_parent is None or pids_parent is None:
            raise OSError("no writable memory and pids cgroup for this worker")
        limits = cls(memory_parent / name, pids_parent / name, memory_bytes)
        for directory in {limits.memory_dir, limits.pids_dir}:
            directory.mkdir(exist_ok=True)
        (limits.pids_dir / "pids.max").write_text(str(max_processes))
        if memory_bytes is not None:
            limits.set_memory(memory_bytes)
        return limits

    def set_memory(self, memory_bytes: int) -> None:
        """Cap the group's memory (a warm interpreter's, once its attempt is known: workers/warm_pool.py)."""
        self.memory_bytes = memory_bytes
        if self.v2:
            (self.memory_dir / "memory.max").write_text(str(memory_bytes))
        else:
            (self.memory_dir / "memory.limit_in_bytes").write_text(str(memory_bytes))
        with contextlib.suppress(OSError):  # no swap past the limit either (absent without swap accounting)
            if self.v2:
                (self.memory_dir / "memory.swap.max").write_text("0")
            else:
                (self.memory_dir / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))

    @property
    def v2(self) -> bool:
        return (self.memory_dir / "cgroup.controllers").exists()

    @property
    def procs_files(self) -> list[Path]:
        """Where a process writes its pid to enter the attempt's cgroups."""
        return [directory / "cgroup.procs" for directory in dict.fromkeys([self.memory_dir, self.pids_dir])]

    def oom_kills(self) -> int:
        """How many of the attempt's processes the kernel killed for going over the memory limit."""
        try:
            if self.v2:
                events = (self.memory_dir / "memory.events").read_text()
            else:
                events = (self.memory_dir / "memory.oom_control").read_text()
        except OSError:
            return 0
        for line in events.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the cgroups once their processes are gone (a killed process leaves it a moment later)."""
        for directory in dict.fromkeys([self.memory_dir, self.pids_dir]):
            for _ in range(50):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def limited(command: list[str], open_files: int, cgroups: AttemptLimits | None, memory_bytes: int | None) -> list[str]:
    """`command`, run by a shell that first enters the attempt's cgroups (so the command and all it
    starts are counted from their first page: subprocess can't start a child inside a cgroup, and
    preexec_fn is unsafe in a threaded worker) and caps open files. Without cgroups, memory is
    capped by address space (RLIMIT_AS): crude with PyTorch, which reserves more than it uses, but
    still a bound."""
    steps = [f'echo $$ > "{procs}" || exit 125' for procs in (cgroups.procs_files if cgroups else [])]
    steps.append(f"ulimit -n {min(open_files, resource.getrlimit(resource.RLIMIT_NOFILE)[1])}")
    if cgroups is None and memory_bytes is not None:
        steps.append(f"ulimit -v {memory_bytes // 1024}")
    return ["/bin/sh", "-c", "; ".join(steps) + '; exec "$@"', "sh", *command]
