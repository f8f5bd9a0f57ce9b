"""Celery wiring shared by the scheduler (sends) and the workers (consume).

The broker only carries "run attempt X" to host X's queue; the database holds every state, so a
lost or repeated message is harmless: the scheduler re-sends unclaimed attempts after a timeout,
and a worker ignores an attempt that is no longer `scheduled`.
"""

from __future__ import annotations

import time

import kombu.transport
from celery import Celery

from common.settings import Settings

RUN_ATTEMPT_TASK = "trainyard.run_attempt"


def host_queue(host_name: str) -> str:
    return f"host.{host_name}"


def make_celery(settings: Settings) -> Celery:
    url = settings.resolved_broker_url
    transport_options: dict = {}
    if url.startswith("sqla+"):
        # Our transport for "sqla+" URLs (kombu imports it by this name when a connection opens).
        # Its transport options all go to create_engine(), so they carry SQLite's lock wait.
        kombu.transport.TRANSPORT_ALIASES["sqla"] = "common.sqla_transport:SQLAlchemyTransport"
        if "sqlite" in url:
            transport_options = {"connect_args": {"timeout": 60}}
    app = Celery("trainyard", broker=url)
    app.conf.update(
        # Ack on receipt. An attempt lasts hours and its message is worth nothing once claimed:
        # the database and the lease track it, and the scheduler re-sends an unclaimed dispatch.
        # Held unacked, it made the worker crash when the Redis connection dropped (kombu tried
        # to restore it over the closed connection) and stop consuming for good.
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue="trainyard.default",
        broker_connection_retry_on_startup=True,
        broker_transport_options=transport_options,
        worker_hijack_root_logger=False,
    )
    return app


def dispatch_attempt(app: Celery, attempt_id: int, host_name: str) -> None:
    app.send_task(RUN_ATTEMPT_TASK, args=[attempt_id], queue=host_queue(host_name))


def declare_host_queue(app: Celery, host_name: str) -> None:
    """Create a host's queue; a worker does so before it registers the host, so no dispatch can
    be sent to it while its Celery consumer declares it. The SQLAlchemy transport creates a
    queue with a SELECT, then an INSERT: when the scheduler's send did the same at that moment,
    one INSERT failed on the unique name, and in the consumer Celery takes that for an
    unrecoverable error: the worker stopped for good, just as its first attempt was sent. Other
    brokers need nothing here (a Redis queue is a list that the first message creates)."""
    if not app.conf.broker_url.startswith("sqla+"):
        return
    for last_try in (False, False, True):
        try:
            with app.connection_for_write() as connection:  # a new one each try: a failed one stays failed
                connection.default_channel.queue_declare(queue=host_queue(host_name))
            return
        except Exception:
            if last_try:
                raise
            time.sleep(0.2)  # someone else created it meanwhile: the next SELECT finds it
