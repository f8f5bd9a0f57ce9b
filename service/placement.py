"""Where a job fits: what each host has free, which GPUs a job would get there, and why it waits.

Pure functions of hosts and their reservations, used by the scheduler to place jobs and by the API
to refuse at once a job that no registered host could ever run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api_schemas import ResourcesConfig
from service.db.models import WorkerHost


@dataclass
class HostRoom:
    """What a host has free right now: process slots, and on GPU hosts which GPUs (index → memory)."""

    device: str
    free_slots: int
    free_gpus: dict[int, float] = field(default_factory=dict)

    @classmethod
    def of(cls, host: WorkerHost, busy_slots: dict[str, int], busy_gpus: dict[str, set[int]]) -> HostRoom:
        gpus = {gpu["index"]: gpu["memory_gb"] for gpu in (host.info or {}).get("gpus", [])}
        busy = busy_gpus.get(host.name, set())
        free_gpus = {index: memory for index, memory in gpus.items() if index not in busy}
        return cls(host.device, host.slots - busy_slots.get(host.name, 0), free_gpus)

    def offer(self, resources: ResourcesConfig) -> list[int] | None:
        """The GPU indices (cuda) or [] (cpu) one node of the job would get here now; None if it doesn't fit."""
        if self.device != resources.device or self.free_slots < resources.processes_per_node:
            return None
        if resources.device == "cpu":
            return []
        usable = [index for index, memory in sorted(self.free_gpus.items()) if memory >= (resources.min_gpu_memory_gb or 0)]
        return usable[: resources.processes_per_node] if len(usable) >= resources.processes_per_node else None

    def size(self, resources: ResourcesConfig) -> int:
        return len(self.free_gpus) if resources.device == "cuda" else self.free_slots

    def take(self, slots: int, gpus: list[int] | None) -> None:
        self.free_slots -= slots
        for index in gpus or []:
            self.free_gpus.pop(index, None)


def waiting_reason(resources: ResourcesConfig, fitting_now: int) -> str:
    what = "GPUs" if resources.device == "cuda" else "CPU slots"
    memory = f" of at least {resources.min_gpu_memory_gb:g} GB" if resources.min_gpu_memory_gb else ""
    hosts = "a host" if resources.nodes == 1 else f"{resources.nodes} hosts"
    return f"waiting for {hosts} with {resources.processes_per_node} free {what}{memory} ({fitting_now} now)"


def never_fits(resources: ResourcesConfig, hosts: list[WorkerHost]) -> str | None:
    """Why no registered host could ever run the job, even idle; None if some could (or none are
    registered yet: hosts may join later)."""
    if not hosts:
        return None
    able = sum(HostRoom.of(host, {}, {}).offer(resources) is not None for host in hosts)
    if able >= resources.nodes:
        return None
    kinds = ", ".join(sorted(f"{host.name} ({host.slots} {host.device})" for host in hosts))
    return f"no {resources.nodes} registered hosts could ever run it ({able} could); registered: {kinds}"
