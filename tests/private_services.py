"""Private PostgreSQL and Redis servers: for the tests that stop and start them (test_restarts.py),
and for `make test` on a machine where none answers.

    python -m tests.private_services -- python -m pytest [ARGS]

runs the command with TRAINYARD_TEST_POSTGRES_URL and TRAINYARD_TEST_REDIS_URL (what tests/conftest.py
reads) naming servers that answer: the configured ones (by default PostgreSQL at 127.0.0.1:5432, Redis
at 127.0.0.1:6379) when they do, else private ones started here on free ports and stopped when the
command ends, whatever its outcome; it exits with the command's status. Where a private one can't
start either (no binaries: the Makefile installs Debian's), the URL is left as it was, and the tests
that need it skip, or fail with CI=true, as they would have.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import sqlalchemy as sa

from workers.supervisor import free_port

POSTGRES_URL_VARIABLE, DEFAULT_POSTGRES_URL = "TRAINYARD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS_URL_VARIABLE, DEFAULT_REDIS_URL = "TRAINYARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"


def configured_postgres_url() -> str:
    return os.environ.get(POSTGRES_URL_VARIABLE, DEFAULT_POSTGRES_URL)


def configured_redis_url() -> str:
    return os.environ.get(REDIS_URL_VARIABLE, DEFAULT_REDIS_URL)


def postgres_binary(name: str) -> str | None:
    """On PATH, or where Debian's packages put it (/usr/lib/postgresql/<version>/bin)."""
    return shutil.which(name) or max(map(str, Path("/usr/lib/postgresql").glob(f"*/bin/{name}")), default=None)


def why_no_private_postgres() -> str | None:
    """Why this machine can't run a private PostgreSQL cluster; None if it can."""
    if postgres_binary("initdb") is None or postgres_binary("pg_ctl") is None:
        return "PostgreSQL's initdb and pg_ctl are not on PATH nor in /usr/lib/postgresql/*/bin"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "there is no `postgres` user to run PostgreSQL as (it refuses root)"
    return None


def why_no_private_redis() -> str | None:
    return "redis-server is not on PATH" if shutil.which("redis-server") is None else None


class RedisServer:
    """A private, memory-only redis-server: a restart loses every message, as a crash would."""

    def __init__(self, directory: Path, db: int = 0):
        self.directory, self.port = directory, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/{db}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        import redis

        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", str(self.directory)]
        with open(self.directory / "redis.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(20)


class PostgresCluster:
    """A private PostgreSQL cluster on a free port, trust auth, its socket in its own directory, and
    `database` in it once create_database() has run.

    PostgreSQL refuses to run as root, so as root the cluster belongs to the `postgres` user."""

    def __init__(self, database: str = "trainyard"):
        initdb, self.pg_ctl = postgres_binary("initdb"), postgres_binary("pg_ctl")
        self.port, self.database = free_port(), database
        self.user = "postgres" if os.geteuid() == 0 else None
        # Short and outside the project and pytest's root-only tmp dir: the socket path has a ~100-byte
        # limit, and the `postgres` user must be able to reach it.
        self.directory = Path(tempfile.mkdtemp(prefix="trainyard-pg-"))
        if self.user:
            shutil.chown(self.directory, self.user)
        self.data = self.directory / "data"
        self._run(initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *command: str) -> None:
        result = subprocess.run(command, user=self.user, capture_output=True, text=True)
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(self.pg_ctl, "-D", str(self.data), "-l", str(self.directory / "postgres.log"), "-o", options, "-w", "start")

    def stop(self) -> None:
        # Fast shutdown: open connections are cut, as a crash or a failover would cut them.
        self._run(self.pg_ctl, "-D", str(self.data), "-m", "fast", "-w", "stop")

    def create_database(self) -> None:
        admin = sa.create_engine(self.url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.execute(sa.text(f'CREATE DATABASE "{self.database}"'))
        admin.dispose()

    def remove(self) -> None:
        subprocess.run([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"], user=self.user, capture_output=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def postgres_problem(url: str) -> str | None:
    """Why `url` can't be used as the tests use it (connect, run a query); None if it can."""
    engine = sa.create_engine(url, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except Exception as exc:
        return str(exc).splitlines()[0]
    finally:
        engine.dispose()
    return None


def redis_problem(url: str) -> str | None:
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=5).ping()
    except Exception as exc:
        return str(exc)
    return None


def say(message: str) -> None:
    print(f"tests/private_services.py: {message}", file=sys.stderr, flush=True)


def use_or_start_postgres(cleanup: contextlib.ExitStack) -> str:
    """The configured PostgreSQL's URL if it answers, else a private cluster's (stopped by `cleanup`)."""
    url = configured_postgres_url()
    if (problem := postgres_problem(url)) is None:
        return url
    if why_not := why_no_private_postgres():
        say(f"PostgreSQL at {url} does not answer ({problem}), and no private one can start: {why_not}")
        return url
    cluster = PostgresCluster(database=sa.make_url(url).database)
    cleanup.callback(cluster.remove)
    cluster.start()
    cluster.create_database()
    say(f"PostgreSQL at {url} does not answer ({problem}): using a private one at {cluster.url} for this run")
    return cluster.url


def use_or_start_redis(cleanup: contextlib.ExitStack) -> str:
    """The configured Redis's URL if it answers, else a private redis-server's (stopped by `cleanup`)."""
    url = configured_redis_url()
    if (problem := redis_problem(url)) is None:
        return url
    if why_not := why_no_private_redis():
        say(f"Redis at {url} does not answer ({problem}), and no private one can start: {why_not}")
        return url
    directory = Path(tempfile.mkdtemp(prefix="trainyard-redis-"))
    cleanup.callback(shutil.rmtree, directory, ignore_errors=True)
    server = RedisServer(directory, db=int(urlsplit(url).path.strip("/") or 0))
    server.start()
    cleanup.callback(server.stop)
    say(f"Redis at {url} does not answer ({problem}): using a private one at {server.url} for this run")
    return server.url


def main(argv: list[str]) -> int:
    command = argv[1:] if argv[:1] == ["--"] else argv
    with contextlib.ExitStack() as cleanup:
        env = {**os.environ, POSTGRES_URL_VARIABLE: use_or_start_postgres(cleanup), REDIS_URL_VARIABLE: use_or_start_redis(cleanup)}
        child = subprocess.Popen(command, env=env)
        # Ctrl-C reaches the command too (one process group): let it finish its own way, then stop
        # the servers; a SIGTERM to this wrapper is passed on, for the same ending.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: child.terminate())
        return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
