"""Addresses of a gang's attempts (workers/gang_network.py gives each one a network namespace): each
worker host that can make them takes a /24 of TRAINYARD_GANG_NETWORK (by its `net_index`, given as it
registers), and each attempt of a gang placed on it an address of that /24 while it runs. The hosts
route each other's /24s, and filter an attempt's packets to the addresses of its own gang."""

from __future__ import annotations

import ipaddress

HOSTS_PER_SUBNET = 253  # .2 … .254 (.0 the network, .1 left to the host, .255 broadcast)


def host_subnet(pool: str, index: int) -> str | None:
    """The `index`-th /24 of the pool; None past its end."""
    network = ipaddress.ip_network(pool)
    if network.prefixlen > 24 or index >= 2 ** (24 - network.prefixlen):
        return None
    return str(ipaddress.ip_network((int(network.network_address) + index * 256, 24)))


def free_address(subnet: str, taken: set[str]) -> str | None:
    """The lowest address of the /24 no running attempt holds; None if all are held."""
    base = ipaddress.ip_network(subnet).network_address
    for offset in range(2, 2 + HOSTS_PER_SUBNET):
        if (address := str(base + offset)) not in taken:
            return address
    return None


def lowest_free_index(taken: set[int]) -> int:
    return next(index for index in range(len(taken) + 1) if index not in taken)
