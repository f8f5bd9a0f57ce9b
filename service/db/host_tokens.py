"""Worker hosts' own tokens: one per host name, only its hash stored; revoking one ends the host's
attempts as a dead host's end (lost, then requeued) and takes it out of the pool."""

from __future__ import annotations

import secrets

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from api_schemas import AttemptStatus
from service.db import state
from service.db.accounts import hash_token
from service.db.dialect import dialect_insert
from service.db.doorbell import ring
from service.db.models import Attempt, HostToken, WorkerHost, utcnow


def issue_host_token(session: Session, host_name: str) -> str:
    """A new token for `host_name`, replacing (and so revoking) any earlier one. The host's registration
    goes with the old token (its process can act no more): the worker given the new one registers at once."""
    token = "tyh_" + secrets.token_urlsafe(32)  # its own prefix: a secret scanner, or a reader, tells it from a user's
    values = {"token_hash": hash_token(token), "created_at": utcnow(), "revoked_at": None}
    insert = dialect_insert(session)(HostToken).values(host_name=host_name, **values)
    session.execute(insert.on_conflict_do_update(index_elements=["host_name"], set_=values))
    session.execute(WorkerHost.__table__.delete().where(WorkerHost.name == host_name))
    session.commit()
    return token


def host_by_token(session: Session, token: str) -> str | None:
    """The name of the host whose live token this is; None for any other string."""
    return session.scalar(HOST_OF_LIVE_TOKEN, {"token_hash": hash_token(token)})


_tokens = HostToken.__table__  # built once on the table: every host request asks (service/db/attempts.py says why)
HOST_OF_LIVE_TOKEN = select(_tokens.c.host_name).where(_tokens.c.token_hash == bindparam("token_hash"), _tokens.c.revoked_at.is_(None))


def revoke_host_token(session: Session, host_name: str) -> bool:
    """Revoke the host's token: it opens nothing from now on. Its attempts end now as lost, saying
    why, and their jobs are requeued (as a dead host's), and the host leaves the pool. False if it
    had no live token."""
    now = utcnow()
    revoked = session.execute(
        update(HostToken).where(HostToken.host_name == host_name, HostToken.revoked_at.is_(None)).values(revoked_at=now)
    ).rowcount
    active = select(Attempt).where(Attempt.host_name == host_name, Attempt.status.in_([AttemptStatus.scheduled, AttemptStatus.running]))
    for attempt in session.scalars(active.with_for_update()).all():
        if attempt.status in (AttemptStatus.scheduled, AttemptStatus.running):  # not ended with its gang's node just before it
            state.end_attempt(session, attempt.job, attempt, AttemptStatus.lost, reason=f"host {host_name}'s token was revoked")
    session.execute(WorkerHost.__table__.delete().where(WorkerHost.name == host_name))
    ring(session)
    session.commit()
    return bool(revoked)

