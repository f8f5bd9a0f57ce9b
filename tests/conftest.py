"""Shared fixtures: real PostgreSQL and Redis on 127.0.0.1, SQLite in a temp dir.

With CI=true a missing PostgreSQL or Redis fails the run; elsewhere those tests are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.db.migrate import upgrade
from service.db.session import session_factory
from service.settings import Settings
from tests.private_services import configured_postgres_url, configured_redis_url

REPO = Path(__file__).resolve().parent.parent
# TRAINYARD_TEST_POSTGRES_URL and TRAINYARD_TEST_REDIS_URL; `make test` points them at private servers when these don't answer.
POSTGRES_ADMIN_URL = configured_postgres_url()

# Two pytest processes run stacks side by side on cores none of their worker hosts knows the other
# uses: OpenMP threads spinning at barriers while their peers wait for a core took the preemption
# test from 50 s alone to 234 s in a full run (2 processes x 2 threads: 1.20 s a step spinning, 0.15 s
# sleeping, on a loaded machine). Waiting threads sleep instead (built-in jobs' training processes
# inherit it from their worker); it changes no result, only how threads wait.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def redis_url_of_this_process(url: str) -> str:
    """The configured Redis, on a database of this pytest-xdist worker's own (gw0 the configured one,
    gw1 the one below it...): the tests empty their database before and after, and a Celery broker on
    it sees only its own stack's queues."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    base, _, db = url.rpartition("/")
    return f"{base}/{(int(db or 0) - int(worker.removeprefix('gw'))) % 16}"


REDIS_URL = redis_url_of_this_process(configured_redis_url())
IN_CI = os.environ.get("CI", "").lower() == "true"


def service_missing(what: str, error: Exception):
    message = f"{what} is not reachable: {error}"
    if IN_CI:
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def postgres_server() -> str:
    try:
        engine = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except Exception as exc:
        service_missing("PostgreSQL", exc)
    return POSTGRES_ADMIN_URL


@pytest.fixture
def empty_postgres_url(postgres_server: str) -> str:
    """A fresh database per test, without tables, dropped afterwards."""
    name = f"trainyard_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = postgres_server.rsplit("/", 1)[0] + f"/{name}"
    yield url
    session_factory(url).kw["bind"].dispose()
    with admin.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def postgres_url(empty_postgres_url: str) -> str:
    """A fresh, migrated database per test, dropped afterwards."""
    upgrade(empty_postgres_url)
    return empty_postgres_url


@pytest.fixture
def redis_url() -> str:
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL)
        client.ping()
    except Exception as exc:
        service_missing("Redis", exc)
    client.flushdb()
    yield REDIS_URL
    client.flushdb()


@pytest.fixture
def empty_sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/trainyard.db"


@pytest.fixture
def sqlite_url(empty_sqlite_url: str) -> str:
    upgrade(empty_sqlite_url)
    return empty_sqlite_url


# `make test-quick` sets TRAINYARD_TEST_BACKENDS=sqlite: the inner loop's tier needs no server.
BACKENDS = os.environ.get("TRAINYARD_TEST_BACKENDS", "sqlite,postgres").split(",")


@pytest.fixture(params=BACKENDS)
def database_url(request) -> str:
    """Data-layer tests run against both backends."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture(params=BACKENDS)
def empty_database_url(request) -> str:
    """database_url before any migration: for tests of the migrations themselves."""
    return request.getfixturevalue(f"empty_{request.param}_url")


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    shutil.copy(REPO / "data" / "tinyshakespeare.txt", root / "tinyshakespeare.txt")
    return root


@pytest.fixture
def settings_overrides() -> dict:
    """Settings a test module runs the service with, beyond the defaults: override it there."""
    return {}


@pytest.fixture
def settings(database_url, data_root, tmp_path, settings_overrides) -> Settings:
    """The service's settings on a fresh database, its data in tmp_path, Tiny Shakespeare in its data root."""
    return Settings(data_dir=tmp_path, database_url=database_url, data_root=data_root, **settings_overrides)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran a stack under its tmp_path shows the end of each process's log:
    an end-to-end failure is only diagnosable from what the API, scheduler and workers said."""
    report = yield
    tmp_path = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if report.failed and tmp_path is not None:
        # The stack's processes log under <data dir>/logs; the namespaced hosts' workers, beside it.
        for log in sorted([*Path(tmp_path).glob("*.log"), *Path(tmp_path).glob("**/logs/*.log")]):
            tail = log.read_text(errors="replace").splitlines()[-80:]
            report.sections.append((f"last lines of {log.relative_to(tmp_path)}", "\n".join(tail)))
    return report
