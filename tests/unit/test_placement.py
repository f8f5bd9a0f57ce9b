"""Best fit through the Rooms index picks what trying every host would pick."""

from __future__ import annotations

import random

from api_schemas import ResourcesConfig
from service.db.models import WorkerHost
from service.placement import HostRoom, Rooms


def brute_force(rooms: dict[str, HostRoom], resources: ResourcesConfig, skip: set[str]):
    offers = {name: devices for name, room in rooms.items() if name not in skip and (devices := room.offer(resources)) is not None}
    if len(offers) < resources.nodes:
        return None
    return [(name, offers[name]) for name in sorted(offers, key=lambda name: (rooms[name].free, name))[: resources.nodes]]


def test_best_fit_through_the_index_is_best_fit_over_every_host():
    rng = random.Random(0)
    hosts = []
    for i in range(60):
        gpus = [{"index": g, "memory_gb": rng.choice([16, 40, 80])} for g in range(rng.choice([2, 4, 8]))]
        device = rng.choice(["cpu", "cuda"])
        hosts.append(WorkerHost(name=f"h{i:02d}", device=device, slots=len(gpus) if device == "cuda" else rng.randint(1, 8),
                                info={"gpus": gpus} if device == "cuda" else {}))
    rooms = Rooms(hosts, {}, {})
    reference = {host.name: HostRoom.of(host, {}, {}) for host in hosts}
    for _ in range(400):
        device = rng.choice(["cpu", "cuda"])
        resources = ResourcesConfig(
            device=device, nodes=rng.choice([1, 1, 2, 3]), processes_per_node=rng.randint(1, 4),
            min_gpu_memory_gb=rng.choice([None, 40]) if device == "cuda" else None,
        )
        skip = set(rng.sample(sorted(reference), 3))
        chosen = rooms.best_fit(resources, skip)
        assert chosen == brute_force(reference, resources, skip)
        for name, devices in chosen or []:
            rooms.take(name, resources.processes_per_node, devices)
            reference[name].take(resources.processes_per_node, devices)
        assert rooms.fitting_now(resources, skip) == sum(
            1 for name, room in reference.items() if name not in skip and room.offer(resources) is not None
        )
