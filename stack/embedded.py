"""The embedded stack (`trainyard up`, the demo, the end-to-end tests): API, scheduler and local
worker hosts as child processes of one command (on SQLite and the SQLAlchemy broker transport unless
given the URLs of others)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.settings import Settings

REPO_DATA = Path(__file__).resolve().parent.parent / "data"
REPO_PLUGINS = REPO_DATA.parent / "examples" / "plugins"
ADMIN_NAME = "admin"


@dataclass(frozen=True)
class StackInfo:
    url: str
    token: str
    data_dir: Path
    restart: Callable[[str], None]  # restart("api"): stop that process and start it again, as an operator would
    stop: Callable[[str], None]  # stop("api"): stop that process (an outage), until start("api")
    start: Callable[[str], None]
    exited: Callable[[], dict[str, int]]  # the processes that have exited, by name, with their exit codes
    log_dir: Path


def prepare_embedded(settings: Settings) -> str:
    """Create the data dir, migrate the database, ship the corpus and the example plugins, and return the admin token."""
    from service.db.accounts import create_user, rotate_token, set_can_run_code, user_by_name, user_by_token, why_refused
    from service.db.migrate import upgrade
    from service.db.models import utcnow
    from service.db.session import session_factory

    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    settings.resolved_data_root.mkdir(parents=True, exist_ok=True)
    for corpus in REPO_DATA.glob("*.txt"):
        target = settings.resolved_data_root / corpus.name
        if not target.exists():
            shutil.copy(corpus, target)
    settings.resolved_plugin_dir.mkdir(parents=True, exist_ok=True)
    for plugin in REPO_PLUGINS.glob("*.py"):  # examples/gan.json runs out of the box
        if not (settings.resolved_plugin_dir / plugin.name).exists():
            shutil.copy(plugin, settings.resolved_plugin_dir / plugin.name)
    upgrade(settings.resolved_database_url)

    token_file = data_dir / "token"
    with session_factory(settings.resolved_database_url)() as session:
        token = token_file.read_text().strip() if token_file.exists() else None
        user = user_by_token(session, token) if token else None
        if user is None:
            admin = user_by_name(session, ADMIN_NAME)
            name = ADMIN_NAME if admin is None else f"{ADMIN_NAME}-{int(time.time())}"
            # The embedded single user runs their own scripts on their own machine.
            _, token = create_user(session, name, is_admin=True, can_run_code=True)
            token_file.write_text(token + "\n")
            token_file.chmod(0o600)
        else:
            if why_refused(user, utcnow()):  # the machine's own admin revoked or let expire: the file gets a fresh one
                token, _ = rotate_token(session, user)
                token_file.write_text(token + "\n")
            if not user.can_run_code:  # created before the permission existed
                set_can_run_code(session, user, True)
    return token


def host_token_files(settings: Settings, host_names: list[str]) -> list[Path]:
    """A fresh token for each local worker host, in a file of its own (0600) under the data dir."""
    from service.db.host_tokens import issue_host_token
    from service.db.session import session_factory

    folder = settings.data_dir / "hosts"
    folder.mkdir(mode=0o700, exist_ok=True)
    files = []
    with session_factory(settings.resolved_database_url)() as session:
        for name in host_names:
            path = folder / f"{name}.token"
            path.touch(mode=0o600)
            path.write_text(issue_host_token(session, name) + "\n")
            files.append(path)
    return files


class StackRefused(Exception):
    """The stack can't start as asked; the message says why and what to do, for the user."""


@contextlib.contextmanager
def embedded_stack(
    data_dir: Path,
    port: int,
    workers: int = 1,
    database_url: str | None = None,
    broker_url: str | None = None,
    devices: str | None = None,
    unsafe_no_sandbox: bool = False,
    worker_settings: dict[str, str] | None = None,
    die_with_parent: bool = False,
) -> Iterator[StackInfo]:
    """API, scheduler and `workers` local worker hosts as child processes; stopped on exit.

    By default on SQLite and the SQLAlchemy broker transport in `data_dir`; given URLs, the same
    processes run on PostgreSQL and Redis (the tests use this for the production backends).
    `worker_settings`: TRAINYARD_* variables for the workers only (a host that doesn't mount the store, say).
    `die_with_parent` (`trainyard up`, which starts them all from its main thread): the children
    are stopped by the kernel if this process dies without stopping them (`kill -9`), as they would
    otherwise go on, a second stack beside them. Either way they hold the data directory's lock.
    Raises StackRefused, having started nothing, if another stack runs on `data_dir` or `port` is taken."""
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    with _sole_stack_on(data_dir) as lock:
        _refuse_taken_port(port)
        options = ChildOptions(inherited_lock=lock, die_with_parent=die_with_parent)
        with _running_stack(data_dir, port, workers, database_url, broker_url, devices, unsafe_no_sandbox, worker_settings or {}, options) as info:
            yield info


@dataclass(frozen=True)
class ChildOptions:
    inherited_lock: int  # the data directory's lock: held while any child lives, though this process died
    die_with_parent: bool


def _die_with_parent() -> None:
    """In the child, before it runs: SIGTERM it when its parent's thread that started it ends (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _sole_stack_on(data_dir: Path) -> Iterator[int]:
    """Hold the data directory's lock while the stack runs. A second stack on it would start a
    second scheduler and worker under the same host names and, on exit, delete the first's hosts:
    every job after would wait for ever, with nothing saying why."""
    with open(data_dir / "stack.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            server = data_dir / "server"
            where = f" at {server.read_text().strip()}" if server.exists() else ""
            raise StackRefused(
                f"Trainyard is already running on {data_dir}{where}: use it, or stop it first (Ctrl-C where it runs), "
                "or start another with its own --data-dir and --port"
            ) from None
        yield lock.fileno()  # the lock goes with the file's close, or with this process and its children


def _refuse_taken_port(port: int) -> None:
    if port == 0:
        return  # a free one is chosen
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port a stack just left is free
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise StackRefused(f"port {port} is taken (another Trainyard, or another program): choose another with --port") from None


@contextlib.contextmanager
def _running_stack(
    data_dir: Path, port: int, workers: int, database_url: str | None, broker_url: str | None, devices: str | None,
    unsafe_no_sandbox: bool, worker_settings: dict[str, str], options: ChildOptions,
) -> Iterator[StackInfo]:
    overrides = {"TRAINYARD_DATA_DIR": str(data_dir)}
    if "TRAINYARD_GANG_NETWORK" not in os.environ:
        # Each local stack its own /20 of the gang pool (16 hosts): two on one machine (two users', the
        # tests') route their gangs' addresses in the same routing table, and must not share them.
        part = int(hashlib.sha256(str(data_dir).encode()).hexdigest(), 16) % 1024
        overrides["TRAINYARD_GANG_NETWORK"] = f"100.{64 + part // 16}.{(part % 16) * 16}.0/20"
    if database_url:
        overrides["TRAINYARD_DATABASE_URL"] = database_url
    if broker_url:
        overrides["TRAINYARD_BROKER_URL"] = broker_url
    token = prepare_embedded(Settings(data_dir=data_dir, database_url=database_url, broker_url=broker_url))
    # The workers close the API's port to multi-node jobs, as the database's and broker's (workers/egress.py).
    overrides["TRAINYARD_CONTROL_PLANE_PORTS"] = json.dumps([port] if port else [])
    # For the workers, and for a scheduler that hands jobs to a cluster pool, whose agents are told it.
    overrides["TRAINYARD_API_URL"] = f"http://127.0.0.1:{port}"
    child_env = {**os.environ, **overrides}
    host_names = [f"local-{i}" for i in range(workers)]
    # The workers get the API's address and each its own token, and no database URL: they speak the
    # worker protocol over HTTP, as hosts elsewhere do (api_schemas/host_api.py).
    worker_env = {name: value for name, value in child_env.items() if name != "TRAINYARD_DATABASE_URL"} | worker_settings
    token_files = host_token_files(Settings(data_dir=data_dir, database_url=database_url), host_names)
    log_dir = data_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    devices = devices or f"cpu:{os.cpu_count() or 1}"
    commands = {
        "api": ["api", "--port", str(port)],
        "scheduler": ["scheduler"],
        **{
            f"worker-{i}": ["worker", "--host-name", host, "--devices", devices, "--address", "127.0.0.1"]
            + (["--unsafe-no-sandbox"] if unsafe_no_sandbox else [])
            for i, host in enumerate(host_names)
        },
    }
    url = f"http://127.0.0.1:{port}"
    children: dict[str, subprocess.Popen] = {}
    cores = host_cores(workers)

    def start(name: str) -> None:
        env = child_env
        if name.startswith("worker-"):
            env = {**worker_env, "TRAINYARD_HOST_TOKEN_FILE": str(token_files[int(name.removeprefix("worker-"))])}
        with open(log_dir / f"{name}.log", "ab") as out:
            # -P: not the working directory first on the path, where a project of the user's may have a
            # `common/` or `workers/` package of its own, which the child would import instead of ours.
            children[name] = subprocess.Popen(
                [sys.executable, "-P", "-m", "trainyard", *commands[name]], env=env, stdout=out, stderr=subprocess.STDOUT,
                pass_fds=(options.inherited_lock,), preexec_fn=_die_with_parent if options.die_with_parent else None,
            )
        children[name].log_file = log_dir / f"{name}.log"  # what _wait_for quotes when it exits during start-up
        if name.startswith("worker-") and cores:  # before it starts any process of its own: they inherit it
            os.sched_setaffinity(children[name].pid, cores[int(name.removeprefix("worker-"))])

    def stop(name: str) -> None:
        stop_children([children[name]])

    def start_again(name: str) -> None:
        start(name)
        wait_healthy(url, [child for child in children.values() if child.poll() is None], log_dir)

    def restart(name: str) -> None:
        stop(name)
        start_again(name)

    try:
        # The workers once the API answers: started beside it, each waited for it on its registration
        # backoff (0.2 s doubling to 5 s), so on busy cores it registered up to 5 s after the API was up.
        for name in ("api", "scheduler"):
            start(name)
        wait_healthy(url, list(children.values()), log_dir)
        for name in commands:
            if name.startswith("worker-"):
                start(name)
        # Up means the workers too: a multi-node job submitted before its hosts have registered is
        # refused as one that could never fit.
        wait_for_workers(url, token, host_names, list(children.values()), log_dir)
        (data_dir / "server").write_text(url + "\n")  # beside the token: the CLI below this folder finds both
        exited = lambda: {name: child.returncode for name, child in children.items() if child.poll() is not None}
        yield StackInfo(url=url, token=token, data_dir=data_dir, restart=restart, stop=stop, start=start_again, exited=exited, log_dir=log_dir)
    finally:
        # The workers first, while the API is there to hear them: each stops its running attempts
        # at a checkpoint and reports it. With the API gone at the same moment, a worker retried it
        # until killed 20 s later, and the attempt's last steps waited for its lease to expire.
        stop_children([child for name, child in children.items() if name.startswith("worker-")])
        stop_children([child for name, child in children.items() if not name.startswith("worker-")])


def host_cores(workers: int) -> list[set[int]]:
    """Each local worker host's own share of this machine's cores, as separate machines would have
    theirs (and each sizes its jobs' threads by its own); none to share among fewer cores than hosts."""
    available = sorted(os.sched_getaffinity(0))
    if workers < 2 or len(available) < workers:
        return []
    share = len(available) // workers
    return [set(available[i * share:(i + 1) * share]) for i in range(workers)]


def stop_children(children: list[subprocess.Popen], grace_seconds: float = 20.0) -> None:
    """SIGTERM each, then SIGKILL those not gone within `grace_seconds`, one deadline for all (each
    its own 20 s in turn made a Ctrl-C of `trainyard up` on a busy machine take over a minute)."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_seconds
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"trainyard: {' '.join(map(str, child.args[3:]))} (pid {child.pid}) did not stop within {grace_seconds:g} s; killed", file=sys.stderr)
            child.kill()
            child.wait()


def wait_healthy(url: str, children: list[subprocess.Popen], log_dir: Path | None = None, timeout: float = 60.0) -> None:
    """Until `url`/healthz answers 200; raises if one of `children` exits first or time runs out."""
    _wait_for(lambda: httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200, "the API did not become healthy", children, log_dir, timeout)


def wait_for_workers(url: str, token: str, hosts: list[str], children: list[subprocess.Popen], log_dir: Path, timeout: float = 60.0) -> None:
    """Until every host of `hosts` has registered with the API; raises like wait_healthy."""
    def registered() -> bool:
        answer = httpx.get(f"{url}/v1/workers", headers={"Authorization": f"Bearer {token}"}, timeout=5.0)
        return answer.status_code == 200 and set(hosts) <= {host["name"] for host in answer.json()}

    _wait_for(registered, "the workers did not register", children, log_dir, timeout)


class StartFailed(RuntimeError):
    """A process of the stack exited as it started, or never became ready; the message says which and why."""


def _wait_for(ready, failure: str, children: list[subprocess.Popen], log_dir: Path | None, timeout: float) -> None:
    see_logs = f"; see the logs in {log_dir}" if log_dir else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if exited := next((child for child in children if child.poll() is not None), None):
            raise StartFailed(f"`trainyard {' '.join(map(str, exited.args[4:]))}` exited during start-up ({last_words(exited)}){see_logs}")
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise StartFailed(f"{failure} within {timeout:.0f} s{see_logs}")


def last_words(child: subprocess.Popen) -> str:
    """Why a child of the stack exited: its log's last line (an error says what it refused), else its exit code."""
    try:
        lines = [line for line in Path(child.log_file).read_text(errors="replace").splitlines() if line.strip()]
    except (AttributeError, OSError):
        lines = []
    return lines[-1].strip()[:300] if lines else f"exit code {child.returncode}"
