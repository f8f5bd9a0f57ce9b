"""How often each running attempt's host reports (POST …/report answers with it: Reported).

Every report costs the API a request (its token checked, a transaction), however few points it
carries, so the cost of many hosts is their request rate, not their rows. Left to themselves,
hosts forward what is new every quarter second; 500 of them would offer 2,000 requests a second,
queue up at the API and wait seconds for each answer (bench/agents.py measured it). Instead the
API asks each to report every `running attempts / rate` seconds: the total stays near `rate`,
each report carries more points, and no answer waits in a queue."""

from __future__ import annotations

import threading
import time

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import AttemptStatus
from service.db.models import Attempt

RECOUNT_SECONDS = 5.0  # running attempts are counted this often, by each API process


class ReportPacing:
    def __init__(self, sessions: sessionmaker[Session], reports_per_second: float):
        self.sessions, self.rate = sessions, reports_per_second
        self.running, self.counted_at = 0, float("-inf")
        self.lock = threading.Lock()  # one recount at a time; the others use the last count

    def next_report_seconds(self) -> float:
        if time.monotonic() - self.counted_at >= RECOUNT_SECONDS and self.lock.acquire(blocking=False):
            try:
                with self.sessions() as session:
                    self.running = session.scalar(select(func.count()).select_from(Attempt).where(Attempt.status == AttemptStatus.running))
                self.counted_at = time.monotonic()
            finally:
                self.lock.release()
        return self.running / self.rate
