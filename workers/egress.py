"""The control plane closed to jobs that keep the host's network.

A single-node attempt has a network namespace of its own with loopback only (workers/sandbox.py).
A multi-node gang keeps the host's network to meet its other nodes, and with it could reach the
service's database, broker and API (a job logged in to PostgreSQL as superuser over loopback, and
sent Celery's remote-control `shutdown` through Redis). So a worker running as root adds, for its
lifetime, an nftables table that rejects every TCP connection the sandbox's user (uid 65534, which
every job runs as and nothing of the service does) opens to the service's ports, on any address:
the database's, the broker's and the API's, which the service names as the host registers
(service/api/routes/host_api.py), and the port of the API URL the host itself uses.

Why nftables: it is the kernel's packet filter and its maintained front end; the owner match
(`meta skuid`) picks out the jobs' packets with no change to how the gang meets. What this does
not do: keep one gang from another gang's ports on the same hosts. Where every host of a gang can,
its attempts run in networks of their own instead (workers/gang_network.py), and this is what is
left for a gang whose hosts can't.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess

from workers.sandbox import SANDBOX_UID

log = logging.getLogger("trainyard.worker")

TABLE_PREFIX = "trainyard_worker_"


def table_name(pid: int | None = None) -> str:
    """One table per worker process, named by its pid: several workers may share a machine (and
    every local stack names its hosts local-0, local-1…), and each removes only its own."""
    return f"{TABLE_PREFIX}{os.getpid() if pid is None else pid}"


def close_control_plane(ports: list[int]) -> str | None:
    """Add this worker's table closing `ports` (the service names its own as the host registers);
    what it closes, in words, or None if it can't here (not root, no nft)."""
    ports = sorted(set(ports))
    nft = shutil.which("nft")
    if not ports or nft is None:
        return None
    remove_orphaned_tables(nft)
    rules = (
        f"table inet {table_name()} {{\n"
        f"  chain jobs_out {{\n"
        f"    type filter hook output priority 0; policy accept;\n"
        f"    meta skuid {SANDBOX_UID} tcp dport {{ {', '.join(map(str, ports))} }} reject with tcp reset\n"
        f"  }}\n"
        f"}}\n"
    )
    done = subprocess.run([nft, "-f", "-"], input=rules, capture_output=True, text=True)
    if done.returncode != 0:
        log.warning("could not close the control plane to jobs with nftables: %s", done.stderr.strip())
        return None
    return f"ports {', '.join(map(str, ports))} closed to jobs (nftables)"


def remove_orphaned_tables(nft: str) -> None:
    """Remove the tables of workers that were killed before removing their own (their pid is gone)."""
    listed = subprocess.run([nft, "list", "tables", "inet"], capture_output=True, text=True).stdout
    for pid in re.findall(rf"^table inet {TABLE_PREFIX}(\d+)$", listed, re.MULTILINE):
        if not os.path.exists(f"/proc/{pid}"):
            subprocess.run([nft, "delete", "table", "inet", table_name(int(pid))], capture_output=True)


def open_control_plane() -> None:
    """Remove this worker's table, as it stops."""
    if (nft := shutil.which("nft")) is not None:
        subprocess.run([nft, "delete", "table", "inet", table_name()], capture_output=True)
