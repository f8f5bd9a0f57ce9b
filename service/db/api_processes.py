"""API processes noting that they are up, and the scheduler asking since when one has been.

Hosts renew their attempts' leases only through the API. While no API process is up (stopped for a
deploy, crashed, or cut off from the database), every host is silent, and none of them is gone for
it: were the scheduler to judge the leases meanwhile, it would end every running attempt of the
cluster, though their hosts train on (workers/supervisor.py keeps training while the service is out
of reach). So each API process notes itself every `beat_seconds` (service/api/main.py), and the
scheduler judges a lease lost only once some API process has been up without a break for a whole
lease: every live host has had one to renew through by then. Kubernetes' node controller holds back
its evictions the same way when it hears from no node at all.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import case, delete, select
from sqlalchemy.orm import Session

from service.db.dialect import dialect_insert
from service.db.models import ApiProcess

MISSED_BEATS = 3  # an API process not heard from for this many beats is down
FORGOTTEN_AFTER = timedelta(days=1)  # the rows of processes gone this long are deleted
NO_API_EVER = datetime.min.replace(tzinfo=timezone.utc)  # api_up_since where no API process ever noted itself


def beat_seconds(lease_seconds: float) -> float:
    """How often an API process notes itself: well inside a lease, so a down API is noticed before
    the leases its hosts last renewed run out."""
    return min(5.0, lease_seconds / 6)


def note_api_up(session: Session, name: str, now: datetime, beat: float) -> None:
    """Note that API process `name` is up; it is up since now if this is its first note, or its
    first after a break (the database was out of its reach: no host could renew meanwhile)."""
    insert = dialect_insert(session)(ApiProcess).values(name=name, up_since=now, seen_at=now)
    broke_off = ApiProcess.seen_at < now - timedelta(seconds=MISSED_BEATS * beat)
    session.execute(insert.on_conflict_do_update(
        index_elements=[ApiProcess.name], set_={"seen_at": now, "up_since": case((broke_off, now), else_=ApiProcess.up_since)}
    ))
    session.execute(delete(ApiProcess).where(ApiProcess.seen_at < now - FORGOTTEN_AFTER))
    session.commit()


def api_up_since(session: Session, now: datetime, beat: float) -> datetime | None:
    """Since when some API process has been up without a break; None while none is. NO_API_EVER
    where none ever noted itself: the data layer used without an API (tests, a scheduler's own
    tools), where leases are judged as they expire."""
    processes = session.execute(select(ApiProcess.up_since, ApiProcess.seen_at)).all()
    if not processes:
        return NO_API_EVER
    heard_since = now - timedelta(seconds=MISSED_BEATS * beat)
    return min((up_since for up_since, seen_at in processes if seen_at >= heard_since), default=None)
