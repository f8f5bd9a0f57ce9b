"""Trainyard's client side: the `trainyard` CLI and the Python client, `from trainyard import Client`."""

from trainyard.client import Client, TrainyardError

__all__ = ["Client", "TrainyardError"]
