"""Engine and session factories for SQLite (embedded) and PostgreSQL (production).

Two kinds of session share one engine: `session_factory` for transactions that may write, and
`read_session_factory` for those that only read. On PostgreSQL they are the same. On SQLite a write
transaction begins IMMEDIATE (it takes the one write lock at once, so a read-then-write never fails
half-way with "database is locked"), while a read transaction begins DEFERRED and, under WAL, reads
its snapshot beside the writer without ever taking that lock: API reads never queue a worker's lease
renewal or heartbeat, and never wait for a write themselves.
"""

from __future__ import annotations

import select
import time
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.orm import Session, sessionmaker


# A connection idle for longer than this is pinged before use, whatever its socket says: a server
# whose host went down (power, network) sent no goodbye, and is found this way once it is back.
PING_AFTER_IDLE_SECONDS = 10.0

# How long a SQLite writer waits for the write lock before "database is locked".
SQLITE_BUSY_TIMEOUT_SECONDS = 60

READ_ONLY = "trainyard_read_only"  # an execution option and a Session.info key

# The most connections one process holds to PostgreSQL: the cap the pool had before (5 + 10
# overflow), now kept open once opened (bench/agents.py), less the one an API process listens on
# for its followers (service/api/events.py): 15 in all a process.
POOL_SIZE = 14


def make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        # Up to POOL_SIZE connections, opened as they are first needed and then kept: an "overflow"
        # past a smaller pool is closed at every check-in, so under load each transaction could open
        # a connection (a new PostgreSQL backend, forked and authenticated) and close it again.
        engine = create_engine(url, pool_size=POOL_SIZE, max_overflow=0)

        @event.listens_for(engine, "checkin")
        def _note_idle_since(_dbapi_connection, record):
            record.info["idle_since"] = time.monotonic()

        @event.listens_for(engine, "checkout")
        def _ping_if_it_may_be_closed(dbapi_connection, record, _proxy):
            """Hand out no connection that PostgreSQL has closed, as `pool_pre_ping` does, but
            without its `SELECT 1` round trip at every check-out, one more per transaction. A server
            that ends a connection (restarted, idle timeout, backend terminated) says so on its
            socket, a FATAL message then EOF, while a sound idle connection has nothing to read; a
            server whose host went away says nothing, but is down for longer than
            PING_AFTER_IDLE_SECONDS. So only then is it pinged, with the dialect's own ping; a
            failed ping makes the pool open a new connection in its place."""
            if dbapi_connection.closed:
                raise exc.DisconnectionError("PostgreSQL closed this connection")
            idle_since = record.info.get("idle_since")  # None: opened for this check-out
            incoming = select.poll()  # not select.select(): it fails on descriptors past 1024
            incoming.register(dbapi_connection.fileno(), select.POLLIN)
            if (idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_SECONDS) and not incoming.poll(0):
                return
            try:
                engine.dialect.do_ping(dbapi_connection)  # reads what the server sent (a notice is harmless)
            except Exception as error:
                raise exc.DisconnectionError("PostgreSQL closed this connection") from error

        return engine

    # API, scheduler and workers are separate processes sharing one SQLite file. WAL lets readers
    # run beside the writer; a writer waits for the lock up to the busy timeout (writes are short:
    # nothing holds a write transaction open across a client's network or a file's copy).
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # let the "begin" hook below issue BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN" if connection.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")

    return engine


@lru_cache
def session_factory(url: str) -> sessionmaker[Session]:
    """Sessions that may write (on SQLite: BEGIN IMMEDIATE)."""
    return sessionmaker(make_engine(url), expire_on_commit=False)


class ReadSession(Session):
    """A session that only reads, whose transaction ends with COMMIT when it closes, not ROLLBACK:
    the same to the database for a transaction that wrote nothing, but psycopg forgets every
    statement it prepared on a connection at each ROLLBACK it sees. A token check's read session
    rolled back once a request, so no statement was ever prepared, and PostgreSQL parsed and
    planned every one of every request (bench/README.md, 2026-11-29, thirtieth sitting)."""

    def close(self) -> None:
        if self.in_transaction():
            try:
                self.commit()
            except Exception:  # a transaction already failed: roll it back, as close() does
                pass
        super().close()


@lru_cache
def read_session_factory(url: str) -> sessionmaker[Session]:
    """Sessions that only read (on SQLite: a deferred BEGIN, which takes no write lock). They share
    the writers' engine and pool; one that tries to flush a change is refused before it reaches
    the database, where on SQLite the upgrade to a write lock could fail half-way."""
    engine = session_factory(url).kw["bind"].execution_options(**{READ_ONLY: True})
    return sessionmaker(engine, class_=ReadSession, expire_on_commit=False, info={READ_ONLY: True})


@event.listens_for(Session, "before_flush")
def _refuse_writes_in_a_read_session(session: Session, _flush_context, _instances) -> None:
    if session.info.get(READ_ONLY) and (session.new or session.dirty or session.deleted):
        raise RuntimeError("a read-only session was asked to write: open it with session_factory")
