"""Gang networks (workers/gang_network.py), made for real on this machine (root, ip, nft): two
attempts of one gang reach each other; an attempt of another gang reaches neither, nor they it;
none reaches the host it runs on; closing removes the namespace, its route and its table."""

from __future__ import annotations

import random
import socket
import subprocess
import sys

import pytest

from api_schemas.host_api import GangNode
from workers import gang_network
from workers.gang_network import GangNetwork

pytestmark = pytest.mark.skipif(gang_network.available() is not None, reason=f"gang networks need root, ip and nft: {gang_network.available()}")

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"
LISTEN = "import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', 7777)); s.listen(8); print('up', flush=True); s.accept(); s.accept()"


def reaches(network: GangNetwork, address: str, port: int) -> bool:
    return subprocess.run([*network.command_prefix, sys.executable, "-c", CONNECT, address, str(port)], capture_output=True).returncode == 0


def own_address() -> str | None:
    """This machine's address on its default route, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return None


def test_an_attempt_reaches_its_own_gang_only_and_not_the_host():
    base = random.randrange(10**9, 10**10)  # attempt ids no worker here uses
    gang = [GangNode(node_rank=0, address="100.127.250.2", host_address="127.0.0.1"),
            GangNode(node_rank=1, address="100.127.251.2", host_address="127.0.0.1")]
    other = [GangNode(node_rank=0, address="100.127.250.3", host_address="127.0.0.1")]
    networks = [GangNetwork.open(base, "100.127.250.2", gang, {"127.0.0.1"}), GangNetwork.open(base + 1, "100.127.251.2", gang, {"127.0.0.1"}),
                GangNetwork.open(base + 2, "100.127.250.3", other, {"127.0.0.1"})]
    node_0, node_1, stranger = networks
    listeners = []
    try:
        for network in networks:
            listener = subprocess.Popen([*network.command_prefix, sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
            assert listener.stdout.readline().strip() == "up"
            listeners.append(listener)
        assert reaches(node_1, node_0.address, 7777) and reaches(node_0, node_1.address, 7777)  # its own gang, both ways
        assert not reaches(stranger, node_0.address, 7777) and not reaches(node_0, stranger.address, 7777)  # not another gang's
        with socket.socket() as on_the_host:  # a port of the host, on every address of it
            on_the_host.bind(("0.0.0.0", 0))
            on_the_host.listen(8)
            port = on_the_host.getsockname()[1]
            if (address := own_address()) is not None:
                assert not reaches(node_0, address, port)
            assert not reaches(node_0, "169.254.1.1", port)
    finally:
        for listener in listeners:
            listener.kill()
        for network in networks:
            network.close()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    for network in networks:
        assert network.namespace not in namespaces and network.table not in tables and network.address not in routes
