"""The worker hosts: each registers, heartbeats and deregisters; a host is online while its heartbeat is recent."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.accounts import hash_token
from service.db.dialect import dialect_insert
from service.db.doorbell import ring
from service.db.host_tokens import HOST_OF_LIVE_TOKEN
from service.db.models import WorkerHost, utcnow
from service.db.gang_addresses import lowest_free_index


def register_host(session: Session, name: str, device: str, slots: int, info: dict, address: str = "127.0.0.1") -> int | None:
    """Register (again) the host; its `net_index` (gang_addresses.py) if its info says it makes gang networks."""
    insert = dialect_insert(session)
    now = utcnow()
    values = {"device": device, "slots": slots, "info": info, "address": address, "last_heartbeat": now}
    statement = insert(WorkerHost).values(name=name, registered_at=now, **values)
    session.execute(statement.on_conflict_do_update(index_elements=["name"], set_=values))
    ring(session)  # a new host may fit jobs that are waiting
    session.commit()
    return _net_index(session, name) if info.get("gang_network") else None


def _net_index(session: Session, name: str) -> int:
    """The host's index among those that make gang networks: kept while it stays registered."""
    for _ in range(5):  # two hosts registering at once may pick the same index: the unique key refuses one
        index = session.scalar(select(WorkerHost.net_index).where(WorkerHost.name == name))
        if index is not None:
            return index
        taken = set(session.scalars(select(WorkerHost.net_index).where(WorkerHost.net_index.is_not(None))))
        try:
            session.execute(update(WorkerHost).where(WorkerHost.name == name).values(net_index=lowest_free_index(taken)))
            session.commit()
        except IntegrityError:
            session.rollback()
    raise RuntimeError(f"could not give host {name} a gang network index")


def deregister_host(session: Session, host_name: str) -> None:
    """A host shutting down takes no more attempts (a later start registers it again)."""
    session.execute(delete(WorkerHost).where(WorkerHost.name == host_name))
    session.commit()


def record_heartbeat(session: Session, host_name: str) -> bool:
    """False if the host is not registered (it deregistered, or was taken out of the pool): it should register again."""
    found = note_heartbeat(session, host_name)
    session.commit()
    return found


def note_heartbeat(session: Session, host_name: str) -> bool:
    """record_heartbeat in the caller's transaction, for the caller to commit."""
    return bool(session.execute(_NOTE_HEARTBEAT, {"host": host_name, "now": utcnow()}).rowcount)


def heartbeat_by_token(session: Session, token: str) -> str | None:
    """A heartbeat in one statement that checks the host's token too: the host's name; None if the
    token is no live host token's, or its host is not registered (the caller asks which)."""
    return session.execute(_HEARTBEAT_BY_TOKEN, {"token_hash": hash_token(token), "now": utcnow()}).scalar()


# Every host's heartbeat, built once on the tables (as service/db/attempts.py's lease statements are).
_hosts = WorkerHost.__table__
_NOTE_HEARTBEAT = update(_hosts).where(_hosts.c.name == bindparam("host")).values(last_heartbeat=bindparam("now"))
_HEARTBEAT_BY_TOKEN = (
    update(_hosts).where(_hosts.c.name == HOST_OF_LIVE_TOKEN.scalar_subquery()).values(last_heartbeat=bindparam("now")).returning(_hosts.c.name)
)


def online_hosts(session: Session, now: datetime, host_timeout: float) -> list[WorkerHost]:
    cutoff = now - timedelta(seconds=host_timeout)
    return list(session.scalars(select(WorkerHost).where(WorkerHost.last_heartbeat >= cutoff).order_by(WorkerHost.name)))


def all_hosts(session: Session) -> list[WorkerHost]:
    return list(session.scalars(select(WorkerHost).order_by(WorkerHost.name)))
