"""Connections to PostgreSQL as the pool hands them out (service/db/session.py)."""

from __future__ import annotations

import time

import sqlalchemy as sa

from service.db.session import session_factory


def backend_pid(sessions) -> int:
    with sessions() as session:
        return session.scalar(sa.text("SELECT pg_backend_pid()"))


def test_a_connection_postgresql_ended_is_replaced_before_a_transaction_uses_it_and_a_sound_one_is_kept(postgres_url):
    sessions = session_factory(postgres_url)
    first = backend_pid(sessions)
    assert backend_pid(sessions) == first  # a sound idle connection is handed out again, not reopened

    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            assert connection.scalar(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
            deadline = time.monotonic() + 10
            while connection.scalar(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": first}):
                assert time.monotonic() < deadline, "the terminated backend did not exit"
                time.sleep(0.05)
    finally:
        admin.dispose()

    # The pool's only connection is now closed by the server: the next transaction must get a
    # new one, not fail on the old one (as a restarted PostgreSQL would make every process's do).
    replaced = backend_pid(sessions)
    assert replaced != first
    assert backend_pid(sessions) == replaced


def test_a_sound_connection_with_a_message_waiting_on_its_socket_is_pinged_and_kept(postgres_url):
    sessions = session_factory(postgres_url)
    with sessions() as session:
        pid = session.scalar(sa.text("SELECT pg_backend_pid()"))
        session.execute(sa.text("LISTEN trainyard_test_channel"))
        session.commit()
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(sa.text("NOTIFY trainyard_test_channel"))
    finally:
        admin.dispose()
    time.sleep(0.2)  # the notification is on the idle pooled connection's socket now

    assert backend_pid(sessions) == pid
