"""Throwaway databases for the benchmarks: a migrated PostgreSQL database or SQLite file, gone afterwards.

PostgreSQL is reached at TRAINYARD_BENCH_POSTGRES_URL (default: the test suite's server); the
benchmark's database is created beside the one that URL names and dropped on exit.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator

import sqlalchemy as sa

from service.db.migrate import upgrade
from service.db.session import session_factory

POSTGRES_ADMIN_URL = os.environ.get("TRAINYARD_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
# Redis database 12 is the benchmarks' own; they empty it before and after use.
REDIS_URL = os.environ.get("TRAINYARD_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """The URL of a fresh, migrated PostgreSQL database, dropped on exit."""
    name = f"trainyard_bench_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        upgrade(url)
        yield url
    finally:
        session_factory(url).kw["bind"].dispose()
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextlib.contextmanager
def sqlite_database() -> Iterator[str]:
    """The URL of a fresh, migrated SQLite file in a temporary directory, deleted on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/trainyard.db"
        upgrade(url)
        try:
            yield url
        finally:
            session_factory(url).kw["bind"].dispose()


def database(backend: str) -> contextlib.AbstractContextManager[str]:
    return postgres_database() if backend == "postgres" else sqlite_database()
