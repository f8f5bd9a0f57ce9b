"""The broker transport of the embedded stack: kombu's SQLAlchemy transport, tuned for a queue of
"run attempt X" messages (common/queue.py names it for "sqla+" broker URLs).

Its own module, imported by kombu only when such a connection opens: it imports SQLAlchemy, which
a worker host on Redis never loads (it holds no database library)."""

from __future__ import annotations

import socket
import time

from celery.worker import state as worker_state
from kombu.transport import sqlalchemy as kombu_sqla


class SQLAlchemyTransport(kombu_sqla.Transport):
    """Polls its table every 0.2 s (kombu's 1 s would dominate dispatch latency), and its waits end
    as soon as the worker is stopping: Celery's loop for a polled transport waits 2 s a cycle and
    runs one more cycle once stopping, so a worker's stop took 3-4 s."""

    polling_interval = 0.2

    def drain_events(self, connection, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while worker_state.should_stop is None and worker_state.should_terminate is None:
            try:
                return super().drain_events(connection, timeout=self.polling_interval)
            except socket.timeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
        raise socket.timeout()
