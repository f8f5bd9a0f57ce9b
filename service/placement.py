"""Where a job fits: what each host has free, which GPUs a job would get there, and why it waits.

Pure functions of hosts and their reservations, used by the scheduler to place jobs and by the API
to refuse at once a job that no registered host could ever run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api_schemas import ResourcesConfig
from service.db.models import Attempt, WorkerHost


@dataclass
class HostRoom:
    """What a host has free right now: process slots, and on GPU hosts which GPUs (index → memory)."""

    device: str
    free_slots: int
    free_gpus: dict[int, float] = field(default_factory=dict)
    gpus: dict[int, float] = field(default_factory=dict)  # all of them, free or not

    @classmethod
    def of(cls, host: WorkerHost, busy_slots: dict[str, int], busy_gpus: dict[str, set[int]]) -> HostRoom:
        gpus = {gpu["index"]: gpu["memory_gb"] for gpu in (host.info or {}).get("gpus", [])}
        busy = busy_gpus.get(host.name, set())
        free_gpus = {index: memory for index, memory in gpus.items() if index not in busy}
        return cls(host.device, host.slots - busy_slots.get(host.name, 0), free_gpus, gpus)

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

    def give_back(self, slots: int, gpus: list[int] | None) -> None:
        self.free_slots += slots
        self.free_gpus.update({index: self.gpus[index] for index in gpus or [] if index in self.gpus})


@dataclass
class PreemptionPlan:
    hosts: list[str]
    victims: list[Attempt]  # not yet asked to stop


def preemption_plan(resources: ResourcesConfig, priority: int, rooms: dict[str, HostRoom], running: list[Attempt]) -> PreemptionPlan | None:
    """The hosts where stopping the fewest preemptible attempts of lower priority makes room for the
    job (attempts already asked to stop count as gone, at no cost); None if no such plan exists."""
    options: list[tuple[int, str, list[Attempt]]] = []
    for name, room in rooms.items():
        trial = HostRoom(room.device, room.free_slots, dict(room.free_gpus), room.gpus)
        on_host = sorted((a for a in running if a.host_name == name), key=lambda a: (not a.preempt_requested, a.job.priority, -a.id))
        victims: list[Attempt] = []
        for attempt in on_host:
            if trial.offer(resources) is not None:
                break
            if not attempt.preempt_requested:
                if attempt.job.priority >= priority:
                    break
                victims.append(attempt)
            trial.give_back(attempt.slots, attempt.device_ids)
        if trial.offer(resources) is not None:
            options.append((len(victims), name, victims))
    if len(options) < resources.nodes:
        return None
    chosen = sorted(options, key=lambda option: (option[0], option[1]))[: resources.nodes]
    return PreemptionPlan(hosts=[name for _, name, _ in chosen], victims=[a for _, _, victims in chosen for a in victims])


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
    if resources.nodes == 1:
        return f"no registered host could ever run it; registered: {kinds}"
    return f"it needs {resources.nodes} hosts that could run a node, {able} registered could; registered: {kinds}"
