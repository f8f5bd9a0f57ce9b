"""nginx running deploy/nginx/trainyard.conf as shipped, in front of an API on this machine (tests, bench)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIPPED_CONFIG = REPO / "deploy/nginx/trainyard.conf"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


@contextlib.contextmanager
def nginx_in_front(api_port: int | list[int], artifact_root: Path, workdir: Path, port: int, workers_user: str = "root") -> Iterator[str]:
    """The shipped server block with only the API's address (or addresses: several API processes),
    the artifact path and the port replaced; yields the proxy's base URL. `workers_user`: nginx's
    `user` (when run as root), as a deployment's nginx runs its workers: another account than the service's."""
    server = SHIPPED_CONFIG.read_text()
    apis = " ".join(f"server 127.0.0.1:{api};" for api in ([api_port] if isinstance(api_port, int) else api_port))
    for shipped, ours in [("server api:8000;", apis),
                          ("alias /var/lib/trainyard/artifacts/;", f"alias {artifact_root}/;"),
                          ("listen 80;", f"listen 127.0.0.1:{port};")]:
        assert shipped in server, f"{SHIPPED_CONFIG} no longer has {shipped!r}"
        server = server.replace(shipped, ours)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "server.conf").write_text(server)
    # Run as root, nginx's workers drop to `nobody` by default, who can't reach a test's private tmp directory.
    user = f"user {workers_user};" if os.geteuid() == 0 else ""
    (workdir / "nginx.conf").write_text(f"""
        {user}
        daemon off;
        worker_processes 1;
        pid {workdir}/nginx.pid;
        error_log {workdir}/error.log warn;
        events {{}}
        http {{
            access_log off;
            client_body_temp_path {workdir}/body;
            proxy_temp_path {workdir}/proxy;
            include {workdir}/server.conf;
        }}
    """)
    process = subprocess.Popen([NGINX, "-p", str(workdir), "-c", str(workdir / "nginx.conf")], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {process.stderr.read().decode()}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)
