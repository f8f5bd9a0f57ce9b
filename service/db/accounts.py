"""Users and their API tokens: only a token's hash is stored; a token can expire, be rotated, and be revoked."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.db.models import BrowserSession, User, utcnow


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """Tokens start with "ty_": a bare token_urlsafe can start with "-", which a command line then
    takes for an option (`--token -abc…`), and the prefix lets secret scanners recognise a leak."""
    return "ty_" + secrets.token_urlsafe(32)


def create_user(
    session: Session,
    name: str,
    *,
    is_admin: bool = False,
    can_run_code: bool = False,
    token: str | None = None,
    token_lifetime: timedelta | None = None,
) -> tuple[User, str]:
    """Create a user and return it with its token. With `token_lifetime`, this token and every
    rotated one stop working that long after they were issued."""
    user = User(name=name, is_admin=is_admin, can_run_code=can_run_code)
    user.token_lifetime_s = int(token_lifetime.total_seconds()) if token_lifetime else None
    token = _issue(user, token)
    session.add(user)
    session.commit()
    return user, token


def rotate_token(session: Session, user: User) -> tuple[str, datetime | None]:
    """A new token for `user`; the old one stops working at once, and so do the browser sessions it
    signed in. Returns it and when it expires."""
    token = _issue(user)
    session.execute(delete(BrowserSession).where(BrowserSession.user_id == user.id))
    session.commit()
    return token, user.token_expires_at


def revoke(session: Session, user: User) -> None:
    """No token of this user works again (until an admin rotates one for them)."""
    user.revoked_at = utcnow()
    session.commit()


def _issue(user: User, token: str | None = None) -> str:
    token = token or new_token()
    user.token_hash = hash_token(token)
    user.revoked_at = None
    user.token_expires_at = utcnow() + timedelta(seconds=user.token_lifetime_s) if user.token_lifetime_s else None
    return token


def set_can_run_code(session: Session, user: User, allowed: bool) -> None:
    user.can_run_code = allowed
    session.commit()


def user_by_name(session: Session, name: str) -> User | None:
    return session.scalar(select(User).where(User.name == name))


def user_by_token(session: Session, token: str) -> User | None:
    """The token's user, whatever the token's state; see `why_refused`."""
    return session.scalar(select(User).where(User.token_hash == hash_token(token)))


def why_refused(user: User, now: datetime) -> str | None:
    """Why this user's (otherwise right) token is not accepted now, or None when it is."""
    if user.revoked_at is not None:
        return "token revoked; ask an admin for a new one (`trainyard user rotate`)"
    if user.token_expires_at is not None and user.token_expires_at <= now:
        return f"token expired at {user.token_expires_at.isoformat(timespec='seconds')}; ask an admin for a new one (`trainyard user rotate`)"
    return None
