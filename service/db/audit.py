"""The audit trail: one row per mutating request and code job, written after it is answered."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import AuditEntry


def record(session: Session, **entry) -> None:
    session.add(AuditEntry(**entry))
    session.commit()


def entries(
    session: Session, *, limit: int, before_id: int | None = None, user_name: str | None = None, since: datetime | None = None
) -> list[AuditEntry]:
    """Newest first, `limit` of them, older than `before_id` (a page's cursor)."""
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    if user_name is not None:
        query = query.where(AuditEntry.user_name == user_name)
    if since is not None:
        query = query.where(AuditEntry.at >= since)
    return list(session.scalars(query))
