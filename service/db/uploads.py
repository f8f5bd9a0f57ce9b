"""Uploaded datasets and code bundles: their rows (service/uploads.py receives and unpacks the files)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Upload, User


def create_upload(session: Session, owner: User, kind: str, name: str, sha256: str, size_bytes: int, put_in_place) -> Upload:
    """Record an upload; `put_in_place(upload_id)` moves its files to where the id says, before the
    commit, so a committed row always has its files (a failure there rolls the row back)."""
    upload = Upload(owner_id=owner.id, kind=kind, name=name, sha256=sha256, size_bytes=size_bytes, path="")
    session.add(upload)
    session.flush()
    try:
        upload.path = put_in_place(upload.id)
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return upload


def upload_visible_to(session: Session, user: User, upload_id: int, kind: str) -> Upload | None:
    """The upload if it is of `kind` and `user` owns it or is an admin; None otherwise."""
    upload = session.get(Upload, upload_id)
    if upload is None or upload.kind != kind or (upload.owner_id != user.id and not user.is_admin):
        return None
    return upload


def uploads_visible_to(session: Session, user: User, kind: str) -> list[Upload]:
    query = select(Upload).where(Upload.kind == kind).order_by(Upload.id.desc())
    if not user.is_admin:
        query = query.where(Upload.owner_id == user.id)
    return list(session.scalars(query))
