"""Worker hosts in network namespaces: each its own network stack and address on a private bridge,
so what one host sends another crosses a (virtual) network, as between machines.

Needs root and iproute2 (`ip netns`), which CI has. The hosts reach the service's API at the
bridge's own address (`gateway`), and the embedded broker on the shared filesystem as machines
would reach Redis.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    gateway: str  # the bridge's address: this machine's own, as the hosts reach it


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def can_make_namespaces() -> str | None:
    """None if this process may create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"ty-probe-{uuid.uuid4().hex[:6]}"
    try:
        ip("netns", "add", probe)
        ip("netns", "del", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot create a network namespace: {getattr(exc, 'stderr', b'') or exc}"
    return None


@contextlib.contextmanager
def namespaced_hosts(count: int) -> Iterator[list[Host]]:
    """`count` namespaces joined by a bridge, each with `eth0` at 10.<n>.0.<i + 2>/24; removed afterwards."""
    tag = uuid.uuid4().hex[:5]
    subnet = f"10.{200 + int(tag, 16) % 50}.0"
    bridge = f"tybr{tag}"
    hosts = [Host(f"ty-{tag}-{i}", f"{subnet}.{i + 2}", f"{subnet}.1") for i in range(count)]
    try:
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i, host in enumerate(hosts):
            outside = f"ty{tag}h{i}"
            ip("netns", "add", host.namespace)
            ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            ip("link", "set", outside, "master", bridge, "up")
            ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            ip("-n", host.namespace, "link", "set", "eth0", "up")
            ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in hosts:
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("netns", "del", host.namespace)  # takes its end of the veth pair with it
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("link", "del", bridge)


def start_worker(host: Host, name: str, devices: str, env: dict[str, str], log) -> subprocess.Popen:
    """`trainyard worker` inside the host's namespace, announcing the namespace's own address."""
    command = [
        "ip", "netns", "exec", host.namespace, sys.executable, "-m", "trainyard", "worker",
        "--host-name", name, "--devices", devices, "--address", host.address,
    ]
    # gloo picks the interface the machine's hostname resolves to, which is not in this namespace.
    return subprocess.Popen(command, env={**env, "GLOO_SOCKET_IFNAME": "eth0"}, stdout=log, stderr=subprocess.STDOUT)
