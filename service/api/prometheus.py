"""The body of GET /metrics: the service's state in Prometheus' text format, read from the database.

Everything is computed at scrape time from the database, not kept in in-process counters: the API
may run as several processes, and whichever one answers must report the whole service. Only counts
and host names are exposed, nothing about any user or job.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy.orm import Session

from service.db.hosts import all_hosts, online_hosts
from service.db.scheduler_processes import last_scheduler_pass
from service.db.monitoring import (
    DurationHistogram,
    checkpoint_bytes,
    dispatch_latency_histogram,
    job_counts,
    metric_point_count,
    queue_wait_histogram,
    running_attempt_count,
)
from common.settings import Settings

__all__ = ["CONTENT_TYPE_LATEST", "scrape"]

QUEUE_WAIT_BUCKETS = (1, 5, 15, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 24 * 3600)
DISPATCH_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def scrape(session: Session, settings: Settings, now: datetime) -> bytes:
    return generate_latest(_ServiceCollector(session, settings, now))


class _ServiceCollector(Collector):
    def __init__(self, session: Session, settings: Settings, now: datetime):
        self.session, self.settings, self.now = session, settings, now

    def collect(self) -> Iterator[Metric]:
        session = self.session
        jobs = GaugeMetricFamily("trainyard_jobs", "Jobs by status.", labels=["status"])
        for status, count in job_counts(session, None).items():
            jobs.add_metric([status], count)
        yield jobs
        yield GaugeMetricFamily("trainyard_attempts_running", "Attempts a worker has claimed and is running.", value=running_attempt_count(session))
        yield _histogram(
            "trainyard_job_queue_wait_seconds", "From submission to the first attempt starting, per started job.",
            queue_wait_histogram(session, QUEUE_WAIT_BUCKETS), QUEUE_WAIT_BUCKETS,
        )
        yield _histogram(
            "trainyard_attempt_dispatch_latency_seconds", "From placing an attempt on a host to its worker claiming it.",
            dispatch_latency_histogram(session, DISPATCH_LATENCY_BUCKETS), DISPATCH_LATENCY_BUCKETS,
        )
        yield CounterMetricFamily("trainyard_metric_points", "Training metric points stored.", value=metric_point_count(session))
        yield GaugeMetricFamily("trainyard_checkpoint_bytes", "Bytes of model.safetensors over the checkpoints kept.", value=checkpoint_bytes(session))
        yield from self._hosts()
        if (last := last_scheduler_pass(session)) is not None:  # none ever: no gauge, rather than an age of ever
            yield GaugeMetricFamily("trainyard_scheduler_last_pass_age_seconds", "Seconds since a scheduler last made a pass (nothing is placed while none does).",
                                    value=(self.now - last).total_seconds())

    def _hosts(self) -> Iterable[Metric]:
        online = {host.name for host in online_hosts(self.session, self.now, self.settings.host_timeout_seconds)}
        up = GaugeMetricFamily("trainyard_worker_host_up", "1 while the host heartbeats (it gets new attempts), else 0.", labels=["host"])
        age = GaugeMetricFamily("trainyard_worker_host_heartbeat_age_seconds", "Seconds since the host's last heartbeat.", labels=["host"])
        for host in all_hosts(self.session):
            up.add_metric([host.name], int(host.name in online))
            age.add_metric([host.name], (self.now - host.last_heartbeat).total_seconds())
        return up, age


def _histogram(name: str, documentation: str, histogram: DurationHistogram, bounds: Sequence[float]) -> HistogramMetricFamily:
    """Prometheus' cumulative buckets: each counts the observations at or below its bound."""
    buckets = [(floatToGoString(bound), count) for bound, count in zip(bounds, histogram.at_or_below)]
    buckets.append(("+Inf", histogram.count))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=histogram.total_seconds)
