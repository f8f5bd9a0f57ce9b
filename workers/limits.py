"""An attempt's bounds: memory, CPU and process count as a control group of its own, disk by a watch.

Why a cgroup and not rlimits: RLIMIT_AS counts address space, and PyTorch (CUDA above all) reserves
far more of it than it ever touches, so any useful value breaks healthy jobs; RLIMIT_NPROC counts per
user id, and every sandboxed attempt shares one. A cgroup's memory limit counts the pages really
used, by all of the attempt's processes together (its tmpfs pages, /dev/shm's, too), and the kernel
kills inside the group only (the worker lives on) and counts the kills, so the outcome can say why.
CPU is a quota (cpu.max; v1: cpu.cfs_quota_us): the cores of the slots the attempt holds, whatever
number of processes or threads it starts. Works on cgroup v2 (memory.max, cpu.max, pids.max,
memory.events) and on v1 hierarchies (memory.limit_in_bytes, cpu.cfs_quota_us, memory.oom_control,
pids.max), beside the cgroup the worker runs in; where memory and pids aren't writable, `available()`
says so and the host shows it (GET /v1/workers); where only cpu isn't, CPU goes unbounded.

Disk has no cgroup: DiskWatch measures the attempt's directory on a thread of its own.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000  # the quota's period: 0.1 s, the kernel's default


def own_group(controller: str) -> Path | None:
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
    memory, pids = own_group("memory"), own_group("pids")
    if memory is None or pids is None:
        return None
    version = "cgroup v2" if (memory / "cgroup.controllers").exists() else "cgroup v1"
    return version if own_group("cpu") is not None else f"{version}, CPU unbounded (no writable cpu controller)"


@dataclass(frozen=True)
class SlotShare:
    """One process slot's share of this host, what an attempt is bounded by for each slot it holds
    unless its spec says otherwise: whole cores (at least one: a slot's processes need one to run at
    all) and memory."""

    cores: int
    memory_bytes: int

    @classmethod
    def of_host(cls, slots: int, memory_gb_per_slot: float | None) -> SlotShare:
        """The cores this worker may use (its CPU affinity: a host started on some cores of a
        machine has those) and the machine's memory, divided by its slots; or the operator's figure
        (TRAINYARD_MEMORY_GB_PER_SLOT)."""
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // slots
        if memory_gb_per_slot is not None:
            memory = int(memory_gb_per_slot * 2**30)
        return cls(max(1, len(os.sched_getaffinity(0)) // slots), memory)


@dataclass(frozen=True)
class Bounds:
    """What one attempt may use on one host: memory (None: unbounded) and cores (None: unbounded)."""

    memory_bytes: int | None = None
    cpu_cores: int | None = None


@dataclass
class AttemptLimits:
    """One attempt's cgroups (one per controller on v1, the same directory on v2)."""

    memory_dir: Path
    pids_dir: Path
    cpu_dir: Path | None  # None: this host can't bound CPU
    bounds: Bounds = Bounds()  # what it is held to (a CPU quota only where cpu_dir is)

    @classmethod
    def create(cls, name: str, bounds: Bounds, max_processes: int) -> AttemptLimits:
        memory_parent, pids_parent, cpu_parent = own_group("memory"), own_group("pids"), own_group("cpu")
        if memory_parent is None or pids_parent is None:
            raise OSError("no writable memory and pids cgroup for this worker")
        limits = cls(memory_parent / name, pids_parent / name, cpu_parent / name if cpu_parent else None)
        for directory in limits.directories:
            directory.mkdir(exist_ok=True)
        (limits.pids_dir / "pids.max").write_text(str(max_processes))
        limits.bound(bounds)
        return limits

    @property
    def directories(self) -> list[Path]:
        return list(dict.fromkeys(d for d in (self.memory_dir, self.pids_dir, self.cpu_dir) if d is not None))

    def bound(self, bounds: Bounds) -> None:
        """Apply `bounds` (a warm interpreter's, once its attempt is known: workers/warm_pool.py)."""
        cpu_cores = bounds.cpu_cores if self.cpu_dir is not None else None
        self.bounds = Bounds(memory_bytes=bounds.memory_bytes, cpu_cores=cpu_cores)
        if bounds.memory_bytes is not None:
            self._set_memory(bounds.memory_bytes)
        if cpu_cores is not None:
            quota = bounds.cpu_cores * CPU_PERIOD_US
            if (self.cpu_dir / "cpu.max").exists():
                (self.cpu_dir / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
            else:
                (self.cpu_dir / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (self.cpu_dir / "cpu.cfs_quota_us").write_text(str(quota))

    def _set_memory(self, memory_bytes: int) -> None:
        if self.v2:
            (self.memory_dir / "memory.max").write_text(str(memory_bytes))
        else:
            # v1 refuses a memory limit above the memory+swap one (EINVAL): a group made again under
            # the same name (a killed worker's, left behind) may hold a lower one. Lifted first.
            with contextlib.suppress(OSError):
                (self.memory_dir / "memory.memsw.limit_in_bytes").write_text("-1")
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
        return [directory / "cgroup.procs" for directory in self.directories]

    def throttled(self) -> float:
        """The share of the quota's periods in which the kernel held the attempt's processes back for
        wanting more than their cores (0 where CPU is unbounded)."""
        stat = {}
        with contextlib.suppress(OSError, TypeError):
            stat = dict(line.split(" ", 1) for line in (self.cpu_dir / "cpu.stat").read_text().splitlines())
        periods = int(stat.get("nr_periods", 0))
        return int(stat.get("nr_throttled", 0)) / periods if periods else 0.0

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
        for directory in self.directories:
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


def directory_bytes(directory: Path, skip: frozenset[str] = frozenset()) -> int:
    """The disk space the files under `directory` take (allocated blocks: a sparse file counts what it
    really uses; each file once, however many links it has), leaving out its entries named in `skip`."""
    total, seen, pending = 0, set(), [directory]
    while pending:
        current = pending.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:  # removed meanwhile, or not ours to read
            continue
        for entry in entries:
            if current == directory and entry.name in skip:
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.is_dir(follow_symlinks=False):
                pending.append(Path(entry.path))
            elif (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512
    return total


class DiskWatch:
    """How much an attempt's directory holds, measured every `every` seconds on a thread of its own:
    a directory of a million files takes seconds to walk, and the supervisor renewing the lease must
    not wait for it. `over()` once it holds more than `limit_bytes`."""

    def __init__(self, directory: Path, limit_bytes: int, every: float, skip: frozenset[str] = frozenset()):
        self.directory, self.limit_bytes, self.every, self.skip = directory, limit_bytes, every, skip
        self.used = 0
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name=f"disk-watch-{directory.name}", daemon=True).start()

    def over(self) -> bool:
        return self.used > self.limit_bytes

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while True:
            self.used = directory_bytes(self.directory.resolve(), self.skip)
            if self.stopped.wait(self.every):
                return
