"""A network of its own for each attempt of a multi-node gang: it reaches its own gang and nothing else.

A single-node attempt's sandbox has loopback only (workers/sandbox.py). A gang's ranks must meet
across hosts, and on the hosts' own network they could also reach another gang's ports on the same
hosts (every job runs as one uid: no filter on the hosts' addresses tells two gangs apart), or the
control plane. So, as Kubernetes gives each pod an address of its own, each attempt of a gang gets:

- a network namespace `ty<worker pid>-a<attempt id>` with one interface, `eth0`, holding the
  attempt's address (a /32 of its host's /24, from the service as it claims: service/db/gang_addresses.py)
  and a default route to the host, over a veth pair (`ty<hash of worker pid and attempt id>` on the host side, holding
  the link-local next hop as Calico's veths do: no bridge, so every packet is routed, and filtered);
- on the host, a route to the attempt's /32, and routes to the /24s of the gang's other hosts
  through their addresses (the hosts route each other's attempts: static routes, as on one L2
  network; hosts that share none would need a tunnel, which is not built);
- an nftables table of its own: what enters from the attempt may go to its gang's addresses only,
  what leaves towards it may come from them only, and the host itself (its database, broker, API,
  anything listening on it) is not reachable from it at all (it may only answer its host).

Its sandbox starts inside the namespace (`ip netns exec`), keeping that network, and the ranks meet at
node 0's attempt address. Everything is removed when the attempt ends; what a killed worker left is
removed by the next one to start on the host. Needs root, iproute2 and nft; a host without them
keeps its gangs on its own network, closed to the control plane by workers/egress.py.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from api_schemas.host_api import GangNode

log = logging.getLogger("trainyard.worker")

GANG_INTERFACE = "eth0"  # the attempt's one interface in its namespace: the ranks' collectives use it
GATEWAY = "169.254.1.1"  # the attempt's next hop: the host side of its veth holds it
TABLE_PREFIX = "trainyard_gang_"
NAMESPACE = re.compile(r"^ty(\d+)-a(\d+)$")


class GangNetworkFailed(Exception):
    """The attempt's network could not be made (a command refused): it can't start here."""


def available() -> str | None:
    """None if this host can make gang networks, else why not."""
    if os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    return f"no {', '.join(missing)}" if missing else None


def _run(*command: str, input: str | None = None) -> None:
    done = subprocess.run(command, input=input, capture_output=True, text=True)
    if done.returncode != 0:
        raise GangNetworkFailed(f"{' '.join(command[:4])}…: {done.stderr.strip() or done.stdout.strip()}")


@dataclass(frozen=True)
class GangNetwork:
    """One attempt's network: `command_prefix` runs a command inside it."""

    namespace: str
    veth: str
    table: str
    address: str

    @property
    def command_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    @classmethod
    def open(cls, attempt_id: int, address: str, gang: list[GangNode], own_addresses: set[str]) -> GangNetwork:
        """Make the attempt's namespace, its route and its filter; routes to the gang's other hosts'
        /24s through them (`own_addresses`: this host's, whose attempts need none)."""
        pid = os.getpid()
        # An interface name has 15 characters: this worker's and the attempt's ids, hashed (attempt ids
        # repeat across services on one machine, and a killed worker's interfaces outlive it a while).
        veth = "ty" + hashlib.blake2s(f"{pid}/{attempt_id}".encode(), digest_size=6).hexdigest()
        network = cls(f"ty{pid}-a{attempt_id}", veth, f"{TABLE_PREFIX}{pid}_{attempt_id}", address)
        try:
            network._make(gang, own_addresses)
        except (GangNetworkFailed, OSError):
            network.close()
            raise
        return network

    def _make(self, gang: list[GangNode], own_addresses: set[str]) -> None:
        ns = self.namespace
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", self.veth, "type", "veth", "peer", "name", GANG_INTERFACE, "netns", ns)
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        # The attempt's next hop, on the host's side of each veth (one address on many links, link-scoped).
        _run("ip", "addr", "add", f"{GATEWAY}/32", "dev", self.veth, "scope", "link")
        _run("ip", "link", "set", self.veth, "up")
        _run("ip", "route", "replace", f"{self.address}/32", "dev", self.veth)
        for command in (
            ("link", "set", "lo", "up"), ("link", "set", GANG_INTERFACE, "up"), ("addr", "add", f"{self.address}/32", "dev", GANG_INTERFACE),
            ("route", "add", GATEWAY, "dev", GANG_INTERFACE, "scope", "link"),
            ("route", "add", "default", "via", GATEWAY, "dev", GANG_INTERFACE),
        ):
            _run("ip", "-n", ns, *command)
        for node in gang:  # the other hosts' attempts: through their hosts
            if node.host_address not in own_addresses and not ipaddress.ip_address(node.host_address).is_loopback:
                subnet = ipaddress.ip_network(f"{node.address}/24", strict=False)
                _run("ip", "route", "replace", str(subnet), "via", node.host_address)
        peers = ", ".join(sorted({node.address for node in gang}))
        _run("nft", "-f", "-", input=(
            f"table inet {self.table} {{\n"
            f"  chain forward {{\n"
            f"    type filter hook forward priority 0; policy accept;\n"
            f'    iifname "{self.veth}" ip daddr != {{ {peers} }} drop\n'
            f'    iifname "{self.veth}" meta nfproto ipv6 drop\n'
            f'    oifname "{self.veth}" ip saddr != {{ {peers} }} drop\n'
            f'    oifname "{self.veth}" meta nfproto ipv6 drop\n'
            f"  }}\n"
            f"  chain input {{\n"
            f"    type filter hook input priority 0; policy accept;\n"
            f'    iifname "{self.veth}" ct state established,related accept\n'  # answers to its worker, which may reach it
            f'    iifname "{self.veth}" drop\n'
            f"  }}\n"
            f"}}\n"
        ))

    def close(self) -> None:
        """Remove all of it (the veth goes with the namespace; a route to another host's /24 stays, harmless)."""
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
        subprocess.run(["ip", "route", "del", f"{self.address}/32", "dev", self.veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)


def remove_orphans() -> None:
    """The namespaces and tables of attempts whose worker was killed before removing them (its pid is gone)."""
    if available() is not None:
        return
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in namespaces:
        if (match := NAMESPACE.match(name)) and not os.path.exists(f"/proc/{match.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    tables = subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True).stdout
    for pid, attempt in re.findall(rf"^table inet {TABLE_PREFIX}(\d+)_(\d+)$", tables, re.MULTILINE):
        if not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["nft", "delete", "table", "inet", f"{TABLE_PREFIX}{pid}_{attempt}"], capture_output=True)
