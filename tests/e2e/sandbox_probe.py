"""A hostile job (tests/e2e/test_sandbox.py): run as a `script` job's entrypoint (targets as JSON in
its first argument) or as a `custom` plugin (`sandbox_probe:train`, targets in model.config). It tries
to reach what is not its own; each try prints `BLOCKED <name>: <why>` or `LEAK <name>`. Imports
nothing of the project: it is user code."""

import json
import os
import socket
import sys
import threading

THREAD_CEILING = 20_000  # far past the sandbox's process limit


def probe(targets: dict) -> None:
    tries = {f"read {name}": _reader(path) for name, path in targets["read"].items()}
    tries |= {f"list {name}": _lister(path) for name, path in targets["list"].items()}
    tries |= {f"write {name}": _writer(path) for name, path in targets["write"].items()}
    tries |= {f"connect {name}": _connector(port) for name, port in targets["connect"].items()}
    tries |= {
        "read /proc/1/environ": _reader("/proc/1/environ"),
        "see other processes' credentials": _credentials_in_proc,
        "inherit credentials": _credentials_in_environment,
        "start threads without bound": _threads_without_bound,
    }
    for name, attempt in tries.items():
        try:
            attempt()
        except Exception as exc:  # the sandbox said no
            print(f"BLOCKED {name}: {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"LEAK {name}", flush=True)


def _reader(path: str):
    return lambda: open(path, "rb").read(1)


def _lister(path: str):
    def list_it():
        if not os.listdir(path):
            raise FileNotFoundError(f"{path} is empty here")
    return list_it


def _writer(path: str):
    return lambda: open(os.path.join(path, "written-by-a-job"), "w").write("x")


def _connector(port: int):
    return lambda: socket.create_connection(("127.0.0.1", port), timeout=2).close()


def _credentials_in_proc() -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if b"TRAINYARD_DATABASE_URL" in environ or b"TRAINYARD_DATA_DIR" in environ:
            return
    raise PermissionError("no process's environment here names the service's")


def _credentials_in_environment() -> None:
    if not {"TRAINYARD_DATABASE_URL", "TRAINYARD_BROKER_URL"} & set(os.environ):
        raise KeyError("no service credential in the environment")


def _threads_without_bound() -> None:
    release, threads = threading.Event(), []
    try:
        for _ in range(THREAD_CEILING):
            thread = threading.Thread(target=release.wait)
            thread.start()
            threads.append(thread)
    except RuntimeError as exc:
        raise RuntimeError(f"stopped after {len(threads)} threads: {exc}") from exc
    finally:
        release.set()
        for thread in threads:
            thread.join()


def train(context) -> None:
    """As a custom plugin."""
    probe(context.config)


if __name__ == "__main__":
    probe(json.loads(sys.argv[1]))
