"""What both sides of the worker boundary run: the service (API, scheduler) and the workers.

- `settings.py`: every process's settings (TRAINYARD_* environment variables), in groups per role;
- `queue.py`: the Celery app, each host's queue, the dispatch message ("run attempt X");
- `sqla_transport.py`: the embedded broker's kombu transport (Celery over SQLite);
- `artifacts.py`: the artifact store's layout, and taking a checkpoint or an output into it (the
  API for hosts that send them, a host that mounts the store for its own).

It imports nothing of the project but `api_schemas`: `workers/` depends on it and never on
`service/` (tests/unit/test_boundaries.py).
"""
