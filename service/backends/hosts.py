"""Trainyard's own registered hosts as an execution backend: each placed attempt is sent to its
host's Celery queue (common/queue.py); the message never is the attempt (the worker claims it)."""

from __future__ import annotations

import logging

from celery import Celery

from common.queue import dispatch_attempt

log = logging.getLogger("trainyard.scheduler")


class HostsBackend:
    def __init__(self, celery: Celery):
        self.celery = celery

    def start(self, placed: list[tuple[int, str]]) -> None:
        for attempt_id, host in placed:
            self._send(attempt_id, host)

    def sync(self) -> None:
        """Nothing of its own: the scheduler's pass reaps expired leases and re-sends unclaimed dispatches."""

    def _send(self, attempt_id: int, host: str) -> None:
        """Send one dispatch, retrying once at once: a first send can race the worker declaring the
        same queue (seen with the SQLAlchemy transport). If both fail, the pass after the dispatch
        timeout re-sends it; one failed send never holds up the others."""
        for last_try in (False, True):
            try:
                dispatch_attempt(self.celery, attempt_id, host)
                return
            except Exception:
                if last_try:
                    log.exception("could not dispatch attempt %s to %s; it is re-sent after the dispatch timeout", attempt_id, host)
