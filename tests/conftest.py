"""Shared fixtures: real PostgreSQL and Redis on 127.0.0.1, SQLite in a temp dir.

With CI=true a missing PostgreSQL or Redis fails the run; elsewhere those tests are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.db.migrate import upgrade
from service.db.session import session_factory
from common.settings import Settings
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
    yield from _database(postgres_server)


def _database(server_url: str, create_options: str = "") -> Iterator[str]:
    name = f"trainyard_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}" {create_options}'))
    url = server_url.rsplit("/", 1)[0] + f"/{name}"
    yield url
    session_factory(url).kw["bind"].dispose()
    with admin.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def migrated_postgres_template(postgres_server: str) -> str:
    """A database migrated once per pytest process, which each test's database copies: a copy takes
    0.03 s, running the migrations 0.2-0.5 s of a busy CPU, for each of some 300 tests."""
    name = f"trainyard_template_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    upgrade(postgres_server.rsplit("/", 1)[0] + f"/{name}")
    yield name
    with admin.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def postgres_url(postgres_server: str, migrated_postgres_template: str) -> str:
    """A fresh, migrated database per test (a copy of the migrated template), dropped afterwards."""
    yield from _database(postgres_server, f'TEMPLATE "{migrated_postgres_template}"')


@pytest.fixture(scope="module")
def module_postgres_url(postgres_server: str, migrated_postgres_template: str) -> str:
    """As postgres_url, for a whole module's tests: for a stack they share."""
    yield from _database(postgres_server, f'TEMPLATE "{migrated_postgres_template}"')


@pytest.fixture
def redis_url() -> str:
    yield from _empty_redis()


@pytest.fixture(scope="module")
def module_redis_url() -> str:
    """As redis_url, for a whole module's tests (none of which may take redis_url: it empties the same database)."""
    yield from _empty_redis()


def _empty_redis() -> Iterator[str]:
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


@pytest.fixture(scope="session")
def migrated_sqlite_template(tmp_path_factory) -> Path:
    """A SQLite database migrated once per pytest process, which each test's database copies (as above)."""
    path = tmp_path_factory.mktemp("template") / "trainyard.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(empty_sqlite_url: str, migrated_sqlite_template: Path) -> str:
    shutil.copyfile(migrated_sqlite_template, empty_sqlite_url.removeprefix("sqlite:///"))
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
    funcargs = getattr(item, "funcargs", {})
    if not report.failed:
        return report
    logs = []
    if (tmp_path := funcargs.get("tmp_path")) is not None:
        # The stack's processes log under <data dir>/logs; the namespaced hosts' workers, beside it.
        logs += [*Path(tmp_path).glob("*.log"), *Path(tmp_path).glob("**/logs/*.log")]
    # A stack a module's tests share (a fixture's StackInfo, alone or in a tuple) logs under its own data dir.
    for value in funcargs.values():
        for part in value if isinstance(value, tuple) else (value,):
            if isinstance(getattr(part, "data_dir", None), Path):
                logs += part.data_dir.glob("logs/*.log")
    for log in sorted(set(logs)):
        tail = log.read_text(errors="replace").splitlines()[-80:]
        report.sections.append((f"last lines of {log}", "\n".join(tail)))
    return report


# The directories whose files take minutes first, so that the many short files of the others fill in at
# the end. pytest-xdist (`make test`: --dist loadfile) does not keep this order: by default it hands out
# files by their number of tests (--loadscope-reorder). Keeping it (--no-loadscope-reorder) was tried on
# 2026-11-29 and ran no faster (21:46 against 16:19 and 19:42), so only a single process follows it.
LONG_FIRST = ("e2e", "training", "service", "client", "deploy", "unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        parts = Path(item.path).relative_to(REPO / "tests").parts
        return LONG_FIRST.index(parts[0]) if len(parts) > 1 and parts[0] in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order
