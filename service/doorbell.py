"""The scheduler's doorbell: whoever makes work for it rings, so a queued job need not wait for the next poll.

On PostgreSQL a ring is `NOTIFY trainyard_scheduler` in the ringing transaction: it is delivered
when that transaction commits and not at all if it rolls back, so the scheduler never wakes for a
job that isn't there yet. The scheduler LISTENs on its own connection and still runs a pass every
`scheduler_interval_seconds` without a ring (lease expiry, re-sends and aging need no ring). On
SQLite (the embedded stack) there is no doorbell and the interval alone paces the scheduler.
"""

from __future__ import annotations

import logging
import time

import psycopg
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

log = logging.getLogger("trainyard.scheduler")

CHANNEL = "trainyard_scheduler"


def ring(session: Session) -> None:
    """Wake the scheduler once this session's transaction commits (PostgreSQL; a no-op elsewhere)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"NOTIFY {CHANNEL}"))


class Doorbell:
    """What the scheduler waits on between passes: a ring or `timeout`, whichever comes first."""

    def __init__(self, database_url: str):
        url = make_url(database_url)
        self._dsn = url.set(drivername="postgresql").render_as_string(hide_password=False) if url.get_backend_name() == "postgresql" else None
        self._connection: psycopg.Connection | None = None

    def listen(self) -> None:
        """Start listening (wait() does it too): rings from transactions committed before this are not heard."""
        if self._dsn is not None and (self._connection is None or self._connection.closed):
            self._connection = psycopg.connect(self._dsn, autocommit=True)
            self._connection.execute(f"LISTEN {CHANNEL}")

    def wait(self, timeout: float) -> bool:
        """True if it rang, False after `timeout` seconds of silence (or with no doorbell)."""
        if self._dsn is None:
            time.sleep(timeout)
            return False
        try:
            self.listen()
            rang = any(True for _ in self._connection.notifies(timeout=timeout, stop_after=1))
            # A burst of submits rings many times; one pass places them all, so take the rings
            # already here, without waiting for more (a wait would delay every job's start by it).
            for _ in self._connection.notifies(timeout=0):
                pass
            return rang
        except psycopg.Error:
            # The database restarting: poll until it is back (the pass itself will say what failed).
            log.debug("scheduler doorbell connection lost; polling meanwhile", exc_info=True)
            self.close()
            time.sleep(timeout)
            return False

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
