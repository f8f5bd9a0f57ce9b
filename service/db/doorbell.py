"""The scheduler's doorbell: whoever makes work for it rings, so a queued job need not wait for the next poll.
(And its small sibling for the API's followers: `tell_followers`, PostgreSQL only.)

A ring is delivered when the ringing transaction commits and not at all if it rolls back, so the
scheduler never wakes for a job that isn't there yet. On PostgreSQL it is `NOTIFY
trainyard_scheduler` in that transaction, heard by the scheduler's LISTEN on its own connection.
SQLite (the embedded stack: API, scheduler and worker are processes of one machine) has no
NOTIFY: there a ring is a datagram sent once the transaction has committed to a Unix socket
beside the database file, which the scheduler binds. Either way the scheduler still runs a pass
every `scheduler_interval_seconds` without a ring (lease expiry, re-sends and aging need none),
so a ring that is lost costs only that wait.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time
from pathlib import Path

import psycopg
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from service.db.dialect import Statement

log = logging.getLogger("trainyard.scheduler")

CHANNEL = "trainyard_scheduler"
FOLLOWERS_CHANNEL = "trainyard_job_items"  # payload: a job id whose events or log lines grew
_RING_ON_COMMIT = "trainyard_doorbell"  # Session.info key: the socket to ring once it commits


def ring(session: Session) -> None:
    """Wake the scheduler once this session's transaction commits."""
    bind = session.get_bind()
    if bind.dialect.name == "postgresql":
        session.execute(text(f"NOTIFY {CHANNEL}"))
    elif (path := socket_path(bind.url)) is not None:
        session.info[_RING_ON_COMMIT] = path


def tell_followers(session: Session, job_id: int) -> None:
    """Wake the API processes' watchers of this job once this transaction commits: a NOTIFY on
    PostgreSQL (one per job and transaction: PostgreSQL folds repeats). On SQLite they poll."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(*followers_told(job_id))


def followers_told(job_id: int) -> Statement:
    """tell_followers on PostgreSQL, as a statement (for service/db/dialect.py's `pipelined`)."""
    return _NOTIFY_FOLLOWERS, {"channel": FOLLOWERS_CHANNEL, "job": str(job_id)}


_NOTIFY_FOLLOWERS = text("SELECT pg_notify(:channel, :job)")


def libpq_dsn(database_url) -> str | None:
    """The database URL as psycopg connects to it, for a connection that LISTENs; None unless PostgreSQL."""
    url = make_url(database_url)
    return url.set(drivername="postgresql").render_as_string(hide_password=False) if url.get_backend_name() == "postgresql" else None


@event.listens_for(Session, "after_commit")
def _ring_after_commit(session: Session) -> None:
    if (path := session.info.pop(_RING_ON_COMMIT, None)) is not None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bell:
            bell.setblocking(False)
            try:
                bell.sendto(b"!", path)
            except OSError:  # no scheduler listening, or its queue full: it polls meanwhile
                pass


@event.listens_for(Session, "after_rollback")
def _no_ring_after_rollback(session: Session) -> None:
    session.info.pop(_RING_ON_COMMIT, None)


def socket_path(url) -> str | None:
    """The embedded doorbell's socket for a SQLite database URL: `<database file>.doorbell`; None
    for other databases, an in-memory one, or a path too long for a Unix socket."""
    url = make_url(url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    path = str(Path(url.database).resolve()) + ".doorbell"
    return path if len(os.fsencode(path)) < 100 else None


class Doorbell:
    """What the scheduler waits on between passes: a ring or `timeout`, whichever comes first."""

    def __init__(self, database_url: str, interrupt: socket.socket | None = None):
        """`interrupt`: a socket whose data ends a wait at once, e.g. one that signal.set_wakeup_fd
        writes to, so a SIGTERM stops the scheduler now instead of after its interval."""
        self._interrupt = interrupt
        self._dsn = libpq_dsn(database_url)
        self._path = socket_path(make_url(database_url))
        self._connection: psycopg.Connection | None = None
        self._socket: socket.socket | None = None
        self._bound: int | None = None  # the inode of our socket file, which close() removes

    def listen(self) -> None:
        """Start listening (wait() does it too): rings from transactions committed before this are not heard."""
        if self._dsn is not None and (self._connection is None or self._connection.closed):
            self._connection = psycopg.connect(self._dsn, autocommit=True)
            self._connection.execute(f"LISTEN {CHANNEL}")
        if self._path is not None and self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            Path(self._path).unlink(missing_ok=True)  # left by a scheduler that was killed
            self._socket.bind(self._path)
            self._socket.setblocking(False)
            self._bound = os.stat(self._path).st_ino

    def wait(self, timeout: float) -> bool:
        """True if it rang, False after `timeout` seconds of silence (or with no doorbell), or at once
        when interrupted."""
        if self._dsn is None and self._path is None:
            self._select([], timeout)
            return False
        try:
            self.listen()
            if self._socket is not None:
                rang = bool(self._select([self._socket], timeout))
                # A burst of submits rings many times; one pass places them all, so take the rings
                # already here, without waiting for more (a wait would delay every job's start by it).
                while rang:
                    try:
                        self._socket.recv(16)
                    except BlockingIOError:
                        break
                return rang
            # Rings already read off the socket (during LISTEN, or a previous burst's) first; then
            # wait on the socket; either way take all that arrived, as above.
            if self._rang_already():
                return True
            return bool(self._select([self._connection.pgconn.socket], timeout)) and self._rang_already()
        except (psycopg.Error, OSError):
            # The database restarting: poll until it is back (the pass itself will say what failed).
            log.debug("scheduler doorbell lost; polling meanwhile", exc_info=True)
            self.close()
            self._select([], timeout)
            return False

    def _rang_already(self) -> bool:
        return any(True for _ in self._connection.notifies(timeout=0))

    def _select(self, readable: list, timeout: float) -> list:
        """Those of `readable` that have data within `timeout`; none if interrupted first."""
        waiting_on = readable + ([self._interrupt] if self._interrupt is not None else [])
        if not waiting_on:
            time.sleep(timeout)
            return []
        ready = select.select(waiting_on, [], [], timeout)[0]
        if self._interrupt not in ready:
            return ready
        while True:  # the interrupt is non-blocking: read it empty, so the next wait waits
            try:
                self._interrupt.recv(64)
            except BlockingIOError:
                return []

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
            # Unless another scheduler has bound the path since (the newest one gets the rings).
            if self._bound == getattr(_stat(self._path), "st_ino", None):
                Path(self._path).unlink(missing_ok=True)


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None
