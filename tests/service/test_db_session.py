"""Connections to PostgreSQL as the pool hands them out (service/db/session.py)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import sqlalchemy as sa

from service.db import session as db_session
from service.db.session import session_factory


def backend_pid(sessions) -> int:
    with sessions() as session:
        return session.scalar(sa.text("SELECT pg_backend_pid()"))


@pytest.fixture
def admin(postgres_url):
    """A connection of its own, outside the pool under test, in autocommit."""
    engine = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        yield connection
    engine.dispose()


def test_a_connection_postgresql_ended_is_replaced_before_a_transaction_uses_it_and_a_sound_one_is_kept(postgres_url, admin):
    sessions = session_factory(postgres_url)
    first = backend_pid(sessions)
    assert backend_pid(sessions) == first  # a sound idle connection is handed out again, not reopened

    assert admin.scalar(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
    deadline = time.monotonic() + 10
    while admin.scalar(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": first}):
        assert time.monotonic() < deadline, "the terminated backend did not exit"
        time.sleep(0.05)

    # The pool's only connection is now closed by the server: the next transaction must get a
    # new one, not fail on the old one (as a restarted PostgreSQL would make every process's do).
    replaced = backend_pid(sessions)
    assert replaced != first
    assert backend_pid(sessions) == replaced


def test_a_sound_connection_with_a_message_waiting_on_its_socket_is_pinged_and_kept(postgres_url, admin):
    sessions = session_factory(postgres_url)
    with sessions() as session:
        pid = session.scalar(sa.text("SELECT pg_backend_pid()"))
        session.execute(sa.text("LISTEN trainyard_test_channel"))
        session.commit()
    admin.execute(sa.text("NOTIFY trainyard_test_channel"))
    time.sleep(0.2)  # the notification is on the idle pooled connection's socket now

    assert backend_pid(sessions) == pid


class HostThatGoesDown:
    """A TCP relay in front of PostgreSQL that can play the server's host going down and coming
    back: its open connections get no goodbye (no FIN, as after a power cut), and once it is back
    the first packet on one of them is answered with a reset, as a rebooted host answers; new
    connections reach the server again."""

    def __init__(self, upstream_port: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream_port, self.generation = upstream_port, 0
        threading.Thread(target=self._accept, daemon=True).start()

    def went_down_and_came_back(self) -> None:
        self.generation += 1

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            born = self.generation
            threading.Thread(target=self._relay, args=(client, server, born, True), daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client, born, False), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, born: int, from_client: bool) -> None:
        while data := _received(source):
            if self.generation != born:  # the host restarted since this connection was opened
                if from_client:
                    source.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    source.close()  # a reset, not a FIN
                return
            sink.sendall(data)


def _received(source: socket.socket) -> bytes:
    try:
        return source.recv(65536)
    except OSError:  # its other direction reset it
        return b""


def test_a_connection_idle_past_the_limit_is_pinged_so_a_server_host_that_went_down_silently_fails_no_transaction(postgres_url, monkeypatch):
    monkeypatch.setattr(db_session, "PING_AFTER_IDLE_SECONDS", 0.5)
    relay = HostThatGoesDown(sa.make_url(postgres_url).port or 5432)
    sessions = session_factory(sa.make_url(postgres_url).set(port=relay.port).render_as_string(hide_password=False))
    try:
        first = backend_pid(sessions)
        relay.went_down_and_came_back()
        time.sleep(0.6)  # the pooled connection's socket has nothing to read: only its idle time says ping it
        assert backend_pid(sessions) != first
    finally:
        sessions.kw["bind"].dispose()
        relay.close()


def test_on_sqlite_a_read_runs_beside_a_held_write_lock_and_a_read_session_refuses_to_write(sqlite_url):
    from service.db.models import User
    from service.db.session import read_session_factory

    with session_factory(sqlite_url)() as writer:
        writer.add(User(name="w", token_hash="x" * 64))
        writer.flush()  # the write lock is held until this transaction ends
        started = time.monotonic()
        with read_session_factory(sqlite_url)() as reader:
            assert reader.scalar(sa.select(sa.func.count()).select_from(User)) == 0  # the last committed snapshot
            assert time.monotonic() - started < 1  # no wait for the writer's lock
            reader.add(User(name="r", token_hash="y" * 64))
            with pytest.raises(RuntimeError, match="read-only session"):
                reader.flush()
        writer.commit()


def test_statements_repeated_across_read_and_write_sessions_get_prepared_on_postgresql(postgres_url):
    # psycopg prepares a statement on its connection once it has run it a few times, and forgets all
    # it prepared at every ROLLBACK it sees. A request's token check reads in a session of its own:
    # had that session ended with ROLLBACK, no statement would ever be prepared, and PostgreSQL would
    # parse and plan each one of each request again (a third of its CPU per report).
    read, write = db_session.read_session_factory(postgres_url), session_factory(postgres_url)
    repeated = sa.text("SELECT count(*) FROM jobs WHERE id = :id")
    for round_ in range(8):
        with read() as session:  # closed without a commit of its own, as a route's dependency is
            session.scalar(repeated, {"id": round_})
        with write() as session:
            session.execute(sa.text("SELECT 1"))
            session.commit()
    with write() as session:
        prepared = session.scalars(sa.text("SELECT statement FROM pg_prepared_statements")).all()
    assert any("FROM jobs WHERE id" in statement for statement in prepared), prepared
