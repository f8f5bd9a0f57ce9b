"""Where placed attempts run: one execution backend per kind of pool, behind one boundary.

The scheduler keeps what is Trainyard's: admission, priorities and quotas, sweeps, the state
machine, checkpoints and the API. A backend takes the tries a pass placed and makes them run, and
reconciles what its engine knows of them with the database:

- `hosts.py`: Trainyard's own registered hosts. The pass chose each attempt's host; the backend
  sends "run attempt X" to that host's Celery queue. (Leases and unclaimed dispatches are the
  pass's own: service/scheduler.py.)
- `slurm.py`: a Slurm partition (TRAINYARD_SLURM_PARTITION), named by jobs as `resources.pool`.
  Slurm places the nodes: each try is one batch job, one agent per node (workers/slurm_agent.py)
  running the attempt as a registered host would, through the worker protocol.

Kubernetes would be a third (docs/kubernetes.md). Every backend's attempts are claimed, leased,
reported and finished through the same worker protocol (api_schemas/host_api.py).
"""

from __future__ import annotations

from typing import Protocol

from common.settings import Settings


def cluster_pools(settings: Settings) -> set[str]:
    """The names of the cluster pools this scheduler runs: the Slurm pool's, if a partition is set."""
    return {settings.slurm_pool} if settings.slurm_partition else set()


class ExecutionBackend(Protocol):
    def start(self, placed: list[tuple[int, str]]) -> None:
        """Make the attempts a committed pass placed run: (attempt id, the host it was placed on)."""

    def sync(self) -> None:
        """Reconcile the engine's view with the database: cancels, tries it ended or lost, its states."""
