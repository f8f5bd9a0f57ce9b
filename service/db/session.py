"""Engine and session factory for SQLite (embedded) and PostgreSQL (production)."""

from __future__ import annotations

import select
import time
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.orm import Session, sessionmaker


# A connection idle for longer than this is pinged before use, whatever its socket says: a server
# whose host went down (power, network) sent no goodbye, and is found this way once it is back.
PING_AFTER_IDLE_SECONDS = 10.0


def make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        engine = create_engine(url, pool_size=5, max_overflow=10)

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

    # API, scheduler and workers are separate processes sharing one SQLite file. WAL lets
    # readers run beside the writer; BEGIN IMMEDIATE takes the write lock at the start of a
    # transaction, so a read-then-write never fails half-way with "database is locked".
    engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

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
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


@lru_cache
def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(make_engine(url), expire_on_commit=False)
