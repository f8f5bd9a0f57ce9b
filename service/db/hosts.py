"""The worker hosts: each registers, heartbeats and deregisters; a host is online while its heartbeat is recent."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from service.db.dialect import dialect_insert
from service.db.doorbell import ring
from service.db.models import WorkerHost, utcnow


def register_host(session: Session, name: str, device: str, slots: int, info: dict, address: str = "127.0.0.1") -> None:
    insert = dialect_insert(session)
    now = utcnow()
    values = {"device": device, "slots": slots, "info": info, "address": address, "last_heartbeat": now}
    statement = insert(WorkerHost).values(name=name, registered_at=now, **values)
    session.execute(statement.on_conflict_do_update(index_elements=["name"], set_=values))
    ring(session)  # a new host may fit jobs that are waiting
    session.commit()


def deregister_host(session: Session, host_name: str) -> None:
    """A host shutting down takes no more attempts (a later start registers it again)."""
    session.execute(delete(WorkerHost).where(WorkerHost.name == host_name))
    session.commit()


def record_heartbeat(session: Session, host_name: str) -> bool:
    """False if the host is not registered (it deregistered, or was taken out of the pool): it should register again."""
    found = session.execute(update(WorkerHost).where(WorkerHost.name == host_name).values(last_heartbeat=utcnow())).rowcount
    session.commit()
    return bool(found)


def online_hosts(session: Session, now: datetime, host_timeout: float) -> list[WorkerHost]:
    cutoff = now - timedelta(seconds=host_timeout)
    return list(session.scalars(select(WorkerHost).where(WorkerHost.last_heartbeat >= cutoff).order_by(WorkerHost.name)))


def all_hosts(session: Session) -> list[WorkerHost]:
    return list(session.scalars(select(WorkerHost).order_by(WorkerHost.name)))
