"""The server's commands: `up` (the embedded stack), `api`, `scheduler`, `worker`, `slurm-agent`, `db upgrade`,
`user create|set|revoke|rotate` and `host token|revoke` (service/user_commands.py).

Users run them as `trainyard <command>`: the client's `trainyard.cli` lists them and hands them here."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from common.settings import Settings, unknown_variables
from service.user_commands import add_host_commands, add_user_commands, host_name
from trainyard.cli import SERVER_COMMANDS
from trainyard.client import Client, token_file


def _settings() -> Settings:
    """The service's settings; without TRAINYARD_DATA_DIR, the data of the `trainyard up` this
    folder is in or below (the nearest `.trainyard/` going up, as the client finds its token)."""
    if os.environ.get("TRAINYARD_DATA_DIR"):
        return Settings()
    return Settings(data_dir=token_file().parent)


def _configure_logging(role: str) -> None:
    from service.logs import configure_logging

    configure_logging(role, _settings().log_format)


def _schema_ready() -> bool:
    """Whether the database opens and is at this release's schema; if not, says what to do."""
    from service.db.migrate import SchemaNotReady, check_schema

    try:
        check_schema(_settings().resolved_database_url)
    except SchemaNotReady as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    return True


def db_upgrade(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import OperationalError

    from service.db.migrate import upgrade

    try:
        before, now = upgrade(_settings().resolved_database_url)
    except OperationalError:
        if not _schema_ready():  # says which database could not be opened, and why, in a line
            return 2
        raise
    if before == now:
        print(f"database schema is up to date (revision {now})")
    else:
        print(f"database schema migrated from {'an empty database' if before is None else f'revision {before}'} to revision {now}")
    return 0


# How long the API keeps an idle connection open for its next request. uvicorn's 5 s is the
# period of a worker's heartbeat and of many a user's polling loop: a request sent as the server
# closes the connection it reuses fails with "Server disconnected without sending a response".
KEEP_ALIVE_SECONDS = 75


def run_api(args: argparse.Namespace) -> int:
    import uvicorn

    from service.api.main import create_app

    from service.logs import QuietMachineTraffic

    if not _schema_ready():  # before logging is set up: the error is a line of its own on stderr
        return 2
    _configure_logging("api")
    app = create_app(_settings())
    # What is alive now (modules, the app, its routes and models) lives as long as the process:
    # frozen out of the garbage collector's scans. Each full collection scanned all of it, holding
    # every request of the process for up to 0.59 s at 1,000 hosts (bench/agents.py); frozen, 0.16 s.
    gc.freeze()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_keep_alive=KEEP_ALIVE_SECONDS,
                            forwarded_allow_ips=args.forwarded_allow_ips)
    logging.getLogger("uvicorn.access").addFilter(QuietMachineTraffic())  # after Config, which configures uvicorn's loggers

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.feeds.closing = True  # followed streams end, to resume elsewhere (service/api/events.py)
            super().handle_exit(sig, frame)

    server = Server(config)
    server.run()
    return 0 if server.started else 3  # as uvicorn.run exits when it could not start (a port in use)


def run_scheduler_command(args: argparse.Namespace) -> int:
    from service.db.session import session_factory
    from common.queue import make_celery
    from service.scheduler import run_scheduler

    if not _schema_ready():
        return 2
    _configure_logging("scheduler")
    settings = _settings()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored (see run_up)
    # A signal also writes a byte here, which ends the scheduler's wait between passes: it stops
    # at once, not after up to an interval (every stack's stop waited for it).
    interrupt, signalled = socket.socketpair()
    interrupt.setblocking(False)
    signalled.setblocking(False)
    signal.set_wakeup_fd(signalled.fileno(), warn_on_full_buffer=False)
    try:
        run_scheduler(
            session_factory(settings.resolved_database_url), make_celery(settings), settings,
            stop=lambda: bool(stopping), interrupt=interrupt,
        )
    except KeyboardInterrupt:
        pass
    return 0


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def run_worker_command(args: argparse.Namespace) -> int:
    from workers.host import run_worker

    _configure_logging(f"worker[{args.host_name}]")
    try:
        run_worker(_settings(), args.host_name, args.devices, args.address or _own_address(), args.unsafe_no_sandbox)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def run_slurm_agent_command(args: argparse.Namespace) -> int:
    from workers.slurm_agent import run_agent

    _configure_logging(f"slurm-agent[{os.environ.get('SLURMD_NODENAME', '?')}]")
    return run_agent(Settings(), [int(i) for i in args.attempts.split(",")], args.threads, args.warm)


def run_up(args: argparse.Namespace) -> int:
    # Ctrl-C stops it, whatever it inherited: a shell starts a background command (`make test &`) with
    # SIGINT ignored, and Python then installs no KeyboardInterrupt of its own (its children exited, it didn't).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from stack.embedded import StackRefused, StartFailed  # here, not above: every server command, a Slurm node's agent too, imports this module

    try:
        return _run_stack(args)
    except (StackRefused, StartFailed) as refused:
        print(f"trainyard up: {refused}", file=sys.stderr)
        return 1


def _run_stack(args: argparse.Namespace) -> int:
    from stack.embedded import embedded_stack

    # The port of the last `up` in this folder, unless told: hosts of the user's own, started with
    # its address, would otherwise lose it when `up` ran again without --port.
    port = args.port or _last_port(Path(args.data_dir)) or DEFAULT_PORT
    with embedded_stack(
        Path(args.data_dir), port, args.workers, devices=args.devices, unsafe_no_sandbox=args.unsafe_no_sandbox, die_with_parent=True,
    ) as stack:
        with Client(server=stack.url, token=stack.token) as client:
            link, _ = client.login_link()
        print(f"Trainyard is up at {stack.url}; dashboard: {link}")
        print("  (that link signs a browser in once, within minutes; `trainyard open` makes another)")
        print(f"data in {stack.data_dir}; admin token in {stack.data_dir / 'token'}; Ctrl-C stops everything")
        if Path(stack.data_dir).name != ".trainyard":  # the CLI finds a `.trainyard/` above its folder by itself, not this one
            print(f"  in another shell, `export TRAINYARD_DATA_DIR={stack.data_dir}` lets the CLI find its server and token")
        stop, started_again = [], {}
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
        try:
            while not stop:
                time.sleep(0.5)
                _start_what_died(stack, started_again)
        except KeyboardInterrupt:
            pass
    return 0


DEFAULT_PORT = 8000


def _last_port(data_dir: Path) -> int | None:
    """The port `trainyard up` last ran on with this data directory (its `server` file), if any."""
    try:
        return urlsplit((data_dir / "server").read_text().strip()).port
    except (OSError, ValueError):
        return None


RESTART_PAUSE_SECONDS = 10.0  # a process that dies again within this of its restart is given up on


def _start_what_died(stack, started_again: dict[str, float]) -> None:
    """A process of the stack that died (killed, or out of memory) is started again, saying so: a
    dead worker left its jobs queued for ever, "waiting for a worker host". One that dies again at
    once would only die again: `up` stops, saying why."""
    from stack.embedded import StartFailed

    for name, code in stack.exited().items():
        log = stack.log_dir / f"{name}.log"
        if time.monotonic() - started_again.get(name, -RESTART_PAUSE_SECONDS) < RESTART_PAUSE_SECONDS:
            raise StartFailed(f"the {name} process exited again (code {code}) right after it was started again; see {log}")
        print(f"trainyard up: the {name} process exited (code {code}); starting it again (its log: {log})", file=sys.stderr, flush=True)
        started_again[name] = time.monotonic()
        stack.start(name)


def port_number(text: str) -> int:
    """argparse's type for --port (was an OverflowError traceback past 65535)."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535, not {text!r}")
    return int(text)


def worker_count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a number of worker hosts, 0 or more, not {text!r}")
    return int(text)


def devices_of_a_host(text: str) -> str:
    """argparse's type for --devices, checked as the worker will (`cpu:0`, or `cuda` on a host
    without a GPU, was a worker that died as `up` started it, its reason in its log alone)."""
    from workers.host import parse_devices

    try:
        parse_devices(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--devices {text!r}: ").removeprefix("--devices cuda: ")) from None
    return text


UNSAFE_NO_SANDBOX_HELP = (
    "run jobs without the bubblewrap sandbox, as this process's own user, seeing all it sees (a single-user machine "
    "without bwrap); without this flag such a host refuses script and custom jobs"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainyard", description="The Trainyard server's commands.")
    subparsers = parser.add_subparsers(dest="command", required=True)

    def command(name: str) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, help=SERVER_COMMANDS[name], description=SERVER_COMMANDS[name])

    up = command("up")
    up.add_argument("--data-dir", default=os.environ.get("TRAINYARD_DATA_DIR", ".trainyard"))
    up.add_argument("--port", type=port_number, help="default: the port it ran on last in this folder, else 8000")
    up.add_argument("--workers", type=worker_count, default=1, help="local worker hosts to start (0: none; hosts of your own join with host tokens)")
    up.add_argument("--devices", type=devices_of_a_host, help="devices of each local worker: cpu:N (default: all cores), cuda:all or cuda:0,1")
    up.add_argument("--unsafe-no-sandbox", action="store_true", help=UNSAFE_NO_SANDBOX_HELP)
    up.set_defaults(func=run_up)

    api = command("api")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument(
        "--forwarded-allow-ips", default=os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1"),
        help="the proxies (addresses or networks, comma-separated) whose X-Forwarded-For names the client: the failed-auth "
             "limit and the audit log count by it (a proxy not listed here is taken for every client at once) "
             "(default: $FORWARDED_ALLOW_IPS, else 127.0.0.1)",
    )
    api.set_defaults(func=run_api)

    command("scheduler").set_defaults(func=run_scheduler_command)

    worker = command("worker")
    worker.add_argument("--host-name", required=True, type=host_name, help="unique name of this host")
    worker.add_argument("--devices", default=f"cpu:{os.cpu_count() or 1}", help="cpu:N, cuda:all or cuda:0,1 (default: cpu:<cores>)")
    worker.add_argument("--address", help="where the other hosts of a multi-node job reach this one (default: this host's IP)")
    worker.add_argument("--unsafe-no-sandbox", action="store_true", help=UNSAFE_NO_SANDBOX_HELP)
    worker.set_defaults(func=run_worker_command)

    agent = command("slurm-agent")
    agent.add_argument("--attempts", required=True, help="the try's attempt ids in node order (SLURM_NODEID picks this node's)")
    agent.add_argument("--threads", type=int, help="threads of each CPU process")
    agent.add_argument("--warm", action="store_true", help="start loading an interpreter for the attempt as the agent starts (workers/warm_pool.py)")
    agent.set_defaults(func=run_slurm_agent_command)

    db_commands = command("db").add_subparsers(dest="db_command", required=True)
    db_commands.add_parser("upgrade", help="migrate the schema to the latest version").set_defaults(func=db_upgrade)

    add_user_commands(command("user"), _settings)
    add_host_commands(command("host"), _settings)
    return parser


def main(argv: list[str]) -> int:
    """`argv` as `trainyard` got it, the command first."""
    args = build_parser().parse_args(argv)
    for warning in unknown_variables(os.environ):
        print(f"trainyard: warning: {warning}", file=sys.stderr)
    os.umask(0o077)  # what the service writes (databases, uploads, artifacts, tokens) is readable by its account only
    return args.func(args)
