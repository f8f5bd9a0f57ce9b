"""Scheduler processes noting their passes, and the API asking when one last ran.

With no scheduler running (stopped, crashed, never started in a new deployment) nothing is placed,
and nothing said so: a job stayed queued with no reason, while /healthz answered ok. Each scheduler
notes itself at its passes that look at leases (at least every `scheduler_interval_seconds`); the
API tells a queued job's owner, the dashboard and /metrics how long none has.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from service.db.dialect import dialect_insert
from service.db.models import SchedulerProcess

MISSED_PASSES = 5  # no pass for this many intervals: no scheduler is running
FORGOTTEN_AFTER = timedelta(days=1)  # the rows of schedulers gone this long are deleted


def note_scheduler_pass(session: Session, name: str, now: datetime) -> None:
    insert = dialect_insert(session)(SchedulerProcess).values(name=name, seen_at=now)
    session.execute(insert.on_conflict_do_update(index_elements=[SchedulerProcess.name], set_={"seen_at": now}))
    session.execute(delete(SchedulerProcess).where(SchedulerProcess.seen_at < now - FORGOTTEN_AFTER))
    session.commit()


def last_scheduler_pass(session: Session) -> datetime | None:
    """When some scheduler last made a pass; None if none ever did."""
    return session.execute(select(func.max(SchedulerProcess.seen_at))).scalar_one_or_none()


def no_scheduler_note(last: datetime | None, now: datetime, interval_seconds: float, waiting_since: datetime) -> str | None:
    """What to tell of a job queued since `waiting_since` when no scheduler has run for a while (its
    `last` pass, last_scheduler_pass's); None while one does (or the job has waited less than that:
    a scheduler starting beside the API)."""
    silent_after = timedelta(seconds=MISSED_PASSES * interval_seconds)
    if last is not None and now - last < silent_after:
        return None
    if last is None:
        if now - waiting_since < silent_after:
            return None
        return "no scheduler has run yet: nothing is placed until `trainyard scheduler` runs"
    return f"no scheduler has made a pass for {(now - last).total_seconds():.0f} s: nothing is placed until `trainyard scheduler` runs again"
