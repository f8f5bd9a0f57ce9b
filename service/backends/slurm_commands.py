"""Slurm's own commands, as the Slurm backend uses them: submit a batch job, read the queue, cancel,
describe a partition. Run with the scheduler's environment (SLURM_CONF, munge) and never inside a
database transaction: each is a round trip to slurmctld. slurm_rest.py does the same four over
slurmrestd, for a scheduler that can't run Slurm's commands (no munge key, another machine)."""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

# sbatch's errors that say the controller could not be reached now, not that the job is wrong.
TRANSIENT = ("Unable to contact slurm controller", "Socket timed out", "Connection refused", "Resource temporarily unavailable", "Zero Bytes were transmitted")


class SlurmError(Exception):
    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class SlurmJob:
    id: str
    name: str
    state: str  # PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, PREEMPTED, NODE_FAIL…
    reason: str  # why a pending job waits (Resources, Priority…), or "None"

    @property
    def shown(self) -> str:
        return f"{self.state} ({self.reason})" if self.reason and self.reason != "None" else self.state


@dataclass(frozen=True)
class BatchJob:
    """What one try asks of Slurm, and the command each of its nodes runs (one task per node)."""

    name: str
    partition: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    memory_gb: float | None
    minutes: int
    output: Path
    environment: dict[str, str]
    command: list[str]
    account: str | None = None
    qos: str | None = None

    def script(self) -> str:
        """The batch script. --no-requeue: Trainyard owns restarts, so a preempted or failed try is
        queued again by the service (resuming from its checkpoint), never run a second time by
        Slurm. --export=NONE: the compute nodes get only what is exported here (the API's URL, the
        try's token file, the shared paths), nothing of the scheduler's own environment."""
        options = [
            f"--job-name={self.name}", f"--partition={self.partition}", f"--nodes={self.nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={self.cpus_per_node}", f"--time={self.minutes}", "--no-requeue", "--export=NONE",
            f"--output={self.output}",
        ]
        if self.gpus_per_node:
            options.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.memory_gb:
            options.append(f"--mem={max(1, round(self.memory_gb * 1024))}M")
        if self.account:
            options.append(f"--account={self.account}")
        if self.qos:
            options.append(f"--qos={self.qos}")
        return "\n".join(["#!/bin/bash", *(f"#SBATCH {option}" for option in options), *self._body()]) + "\n"

    def _body(self) -> list[str]:
        lines = [f"export {name}={shlex.quote(value)}" for name, value in sorted(self.environment.items())]
        # srun inherits --export=NONE from sbatch unless told: the tasks get the script's environment.
        lines.append("exec srun --export=ALL --kill-on-bad-exit=1 --ntasks-per-node=1 " + shlex.join(self.command))
        return lines

    def rest_submission(self, working_directory: Path) -> dict:
        """The same job for slurmrestd's `job/submit` (OpenAPI v0.0.38), which reads no #SBATCH lines:
        the options as fields, the environment given whole (nothing of slurmrestd's own)."""
        job = {
            "name": self.name, "partition": self.partition, "nodes": self.nodes, "tasks_per_node": 1,
            "cpus_per_task": self.cpus_per_node, "time_limit": self.minutes, "requeue": False,
            "standard_output": str(self.output), "current_working_directory": str(working_directory),
            "environment": {"PATH": self.environment.get("PATH", "/usr/bin:/bin")},
        }
        if self.gpus_per_node:
            job["gpus_per_node"] = str(self.gpus_per_node)
        if self.memory_gb:
            job["memory_per_node"] = max(1, round(self.memory_gb * 1024))
        job.update({key: value for key, value in (("account", self.account), ("qos", self.qos)) if value})
        return {"job": job, "script": "\n".join(["#!/bin/bash", *self._body()]) + "\n"}


class SlurmCommands:
    def __init__(self, bin_dir: Path | None = None, timeout_seconds: float = 30.0):
        self.bin_dir, self.timeout_seconds = bin_dir, timeout_seconds

    def _run(self, name: str, *args: str, stdin: str | None = None) -> str:
        command = [str(self.bin_dir / name) if self.bin_dir else name, *args]
        try:
            result = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=self.timeout_seconds)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmError(f"{name}: {exc}", transient=True) from exc
        if result.returncode != 0:
            message = (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"
            raise SlurmError(f"{name}: {message}", transient=any(text in message for text in TRANSIENT))
        return result.stdout

    def submit(self, job: BatchJob) -> str:
        """The new Slurm job's id."""
        return self._run("sbatch", "--parsable", stdin=job.script()).strip().split(";")[0]

    def queue(self) -> dict[str, SlurmJob]:
        """Our jobs Slurm still knows, by id: pending, running and, for MinJobAge after, ended."""
        out = self._run("squeue", "--me", "--states=all", "--noheader", "--format=%i|%j|%T|%r")
        jobs = [SlurmJob(*line.split("|", 3)) for line in out.splitlines() if line.count("|") >= 3]
        return {job.id: job for job in jobs}

    def cancel(self, job_id: str) -> None:
        self._run("scancel", job_id)

    def partition(self, name: str) -> dict:
        """What the partition offers: nodes, and the most CPUs, GPUs and memory one node has."""
        out = self._run("sinfo", "--noheader", f"--partition={name}", "--format=%D|%c|%m|%G|%l")
        nodes = cpus = memory = gpus = 0
        max_minutes = None
        for line in out.splitlines():
            count, node_cpus, node_memory, gres, limit = (line.split("|") + ["", "", "", "", ""])[:5]
            nodes += int(count or 0)
            cpus = max(cpus, _number(node_cpus))
            memory = max(memory, _number(node_memory))
            gpus = max(gpus, gpus_in(gres))
            max_minutes = minutes_in(limit)
        if nodes == 0:
            raise SlurmError(f"sinfo: no partition {name!r}, or it has no nodes", transient=False)
        return {"partition": name, "nodes": nodes, "cpus_per_node": cpus, "gpus_per_node": gpus, "memory_mb": memory, "max_minutes": max_minutes}


def minutes_in(limit: str) -> int | None:
    """A partition's time limit as sinfo prints it (`1-00:00:00`, `2:00:00`, `30:00`), in whole
    minutes; None for none (`infinite`) or what doesn't read as one."""
    days, _, clock = limit.strip().rpartition("-")
    parts = clock.split(":")
    if not (days or "0").isdigit() or not all(part.isdigit() for part in parts) or len(parts) > 3:
        return None
    numbers = [int(part) for part in parts]
    # Slurm's forms: minutes, minutes:seconds, hours:minutes:seconds; after days-, hours[:minutes[:seconds]].
    if days:
        hours, minutes, seconds = (numbers + [0, 0])[:3]
    else:
        hours, minutes, seconds = {1: [0, *numbers, 0], 2: [0, *numbers], 3: numbers}[len(numbers)]
    return int(days or 0) * 1440 + hours * 60 + minutes + (seconds > 0)


def gpus_in(gres: str) -> int:
    """The most GPUs a node's gres names (`gpu:a100:4(S:0),…`), 0 for none."""
    return max((int(found) for found in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres)), default=0)


def _number(text: str) -> int:
    found = re.match(r"\d+", text.strip())
    return int(found.group()) if found else 0
