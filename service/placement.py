"""Where a job fits: what each host has free, which GPUs a job would get there, and why it waits.

Pure functions of hosts and their reservations, used by the scheduler to place jobs and by the API
to refuse at once a job that no registered host could ever run.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
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

    @property
    def free(self) -> int:
        """What best fit compares: free GPUs on a GPU host, free slots on a CPU host."""
        return len(self.free_gpus) if self.device == "cuda" else self.free_slots

    def take(self, slots: int, gpus: list[int] | None) -> None:
        self.free_slots -= slots
        for index in gpus or []:
            self.free_gpus.pop(index, None)

    def give_back(self, slots: int, gpus: list[int] | None) -> None:
        self.free_slots += slots
        self.free_gpus.update({index: self.gpus[index] for index in gpus or [] if index in self.gpus})


class Rooms:
    """Every online host's room, indexed by device and how much it has free, so that best fit looks
    only at hosts big enough, smallest first: trying every host for every job cost a pass over
    10,000 jobs on 1,000 hosts ten million offers."""

    def __init__(self, hosts: list[WorkerHost], busy_slots: dict[str, int], busy_gpus: dict[str, set[int]]):
        self.room = {host.name: HostRoom.of(host, busy_slots, busy_gpus) for host in hosts}
        self.idle = {host.name: HostRoom.of(host, {}, {}) for host in hosts}
        self._by_free: dict[tuple[str, int], list[str]] = {}  # (device, free) -> host names, sorted
        for name in sorted(self.room):
            self._by_free.setdefault(self._key(name), []).append(name)

    def _key(self, name: str) -> tuple[str, int]:
        return self.room[name].device, self.room[name].free

    def _big_enough(self, resources: ResourcesConfig, skip: set[str]) -> Iterator[tuple[str, list[int]]]:
        """(host, the devices it would give) for each host the job fits on now, by (free, name)."""
        wanted = [(device, free) for device, free in self._by_free if device == resources.device and free >= resources.processes_per_node]
        for key in sorted(wanted):
            for name in self._by_free[key]:
                if name not in skip and (devices := self.room[name].offer(resources)) is not None:
                    yield name, devices

    def best_fit(self, resources: ResourcesConfig, skip: set[str]) -> list[tuple[str, list[int]]] | None:
        """The `nodes` hosts with the least room that still fit the job, or None if too few do."""
        chosen = list(itertools.islice(self._big_enough(resources, skip), resources.nodes))
        return chosen if len(chosen) == resources.nodes else None

    def fitting_now(self, resources: ResourcesConfig, skip: set[str]) -> int:
        return sum(1 for _ in self._big_enough(resources, skip))

    def could_ever(self, resources: ResourcesConfig, skip: set[str]) -> list[str]:
        """Hosts that would fit the job if they were idle."""
        return [name for name, idle in self.idle.items() if name not in skip and idle.offer(resources) is not None]

    def take(self, name: str, slots: int, gpus: list[int] | None) -> None:
        names = self._by_free[self._key(name)]
        del names[bisect.bisect_left(names, name)]
        self.room[name].take(slots, gpus)
        bisect.insort(self._by_free.setdefault(self._key(name), []), name)


@dataclass
class PreemptionPlan:
    hosts: list[str]
    victims: list[Attempt]  # not yet asked to stop


def preemption_plan(
    resources: ResourcesConfig, rooms: dict[str, HostRoom], running: list[Attempt], may_stop: Callable[[Attempt], bool]
) -> PreemptionPlan | None:
    """The hosts where stopping the fewest attempts that `may_stop` (lowest priority first, then the
    newest) makes room for the job; attempts already asked to stop count as gone, at no cost. None
    if no such plan exists. The scheduler's rules say who may be stopped: a lower priority that is
    preemptible, or a team's borrowed slots (service/fair_share.py)."""
    options: list[tuple[int, str, list[Attempt]]] = []
    for name, room in rooms.items():
        trial = HostRoom(room.device, room.free_slots, dict(room.free_gpus), room.gpus)
        on_host = sorted(
            (a for a in running if a.host_name == name),
            key=lambda a: (not a.preempt_requested, not may_stop(a), a.job.priority, -a.id),
        )
        victims: list[Attempt] = []
        for attempt in on_host:
            if trial.offer(resources) is not None:
                break
            if not attempt.preempt_requested:
                if not may_stop(attempt):
                    break
                victims.append(attempt)
            trial.give_back(attempt.slots, attempt.device_ids)
        if trial.offer(resources) is not None:
            options.append((len(victims), name, victims))
    if len(options) < resources.nodes:
        return None
    chosen = sorted(options, key=lambda option: (option[0], option[1]))[: resources.nodes]
    return PreemptionPlan(hosts=[name for _, name, _ in chosen], victims=[a for _, _, victims in chosen for a in victims])


def waiting_reason(resources: ResourcesConfig, fitting_now: int, online: int) -> str:
    """`waiting for a host with 2 free CPU slots; 0 hosts have that free now` (the count of hosts
    that could take it, not of free slots: "(0 now)" read as no free slot while one of two was);
    with no host online at all, that (a worker that never came up reads as a full cluster otherwise)."""
    if online == 0:
        return "waiting for a worker host: none is online (`trainyard worker` registers one; GET /v1/workers lists them)"
    count = resources.processes_per_node
    what = ("GPU" if resources.device == "cuda" else "CPU slot") + ("s" if count != 1 else "")
    memory = f" of at least {resources.min_gpu_memory_gb:g} GB" if resources.min_gpu_memory_gb else ""
    hosts = "a host" if resources.nodes == 1 else f"{resources.nodes} hosts"
    have = f"{fitting_now} host{'s have' if fitting_now != 1 else ' has'} that free now"
    return f"waiting for {hosts} with {count} free {what}{memory}; {have}"


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
