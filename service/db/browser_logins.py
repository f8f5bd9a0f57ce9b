"""Signing a browser in without its user's token in a URL: the token asks for a one-time code
(`trainyard open`), the page exchanges the code for a browser session of its own.

The code travels in the link's fragment (`/dashboard#login=…`), which a browser never sends to a
server, so no access log or proxy sees it; it works once, for `login_code_seconds`. The session's
token is the browser's alone: it expires, and ends when its user's token is rotated or the user is
revoked. Only hashes are stored, as for every token."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.db.accounts import hash_token
from service.db.models import BrowserSession, LoginCode, User, utcnow

SESSION_PREFIX = "tyb_"  # a browser's token, told apart from a user's ("ty_") and a host's ("tyh_") at a glance


def issue_login_code(session: Session, user: User, lifetime: timedelta) -> tuple[str, datetime]:
    """A new one-time code for `user`, and when it stops working."""
    code = secrets.token_urlsafe(24)
    expires_at = utcnow() + lifetime
    session.add(LoginCode(code_hash=hash_token(code), user_id=user.id, expires_at=expires_at))
    session.commit()
    return code, expires_at


def redeem_login_code(session: Session, code: str, lifetime: timedelta) -> tuple[str, datetime, User] | None:
    """A browser session's token for a code that is unused and unexpired, when it expires, and whose
    it is; the code is used up. None for any other string (or the code's user revoked meanwhile)."""
    now = utcnow()
    # One UPDATE claims it: of two exchanges of one code at once, one finds it already used.
    user_id = session.scalar(
        update(LoginCode)
        .where(LoginCode.code_hash == hash_token(code), LoginCode.used_at.is_(None), LoginCode.expires_at > now)
        .values(used_at=now)
        .returning(LoginCode.user_id)
    )
    user = session.get(User, user_id) if user_id is not None else None
    if user is None or user.revoked_at is not None:
        session.rollback()
        return None
    token = SESSION_PREFIX + secrets.token_urlsafe(32)
    expires_at = now + lifetime
    session.add(BrowserSession(user_id=user_id, token_hash=hash_token(token), created_at=now, expires_at=expires_at))
    session.commit()
    return token, expires_at, user


def user_by_browser_token(session: Session, token: str) -> User | None:
    """The user a live browser session's token acts as; None for any other string."""
    return session.scalar(
        select(User).join(BrowserSession, BrowserSession.user_id == User.id)
        .where(BrowserSession.token_hash == hash_token(token), BrowserSession.expires_at > utcnow())
    )
