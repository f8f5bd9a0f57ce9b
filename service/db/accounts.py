"""Users and their API tokens; only a token's hash is stored."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import User


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_user(
    session: Session, name: str, *, is_admin: bool = False, can_run_code: bool = False, token: str | None = None
) -> tuple[User, str]:
    """Create a user and return it with its token; only the token's hash is stored.

    Tokens start with "ty_": a bare token_urlsafe can start with "-", which a command line then
    takes for an option (`--token -abc…`), and the prefix lets secret scanners recognise a leak."""
    token = token or "ty_" + secrets.token_urlsafe(32)
    user = User(name=name, token_hash=hash_token(token), is_admin=is_admin, can_run_code=can_run_code)
    session.add(user)
    session.commit()
    return user, token


def set_can_run_code(session: Session, user: User, allowed: bool) -> None:
    user.can_run_code = allowed
    session.commit()


def user_by_name(session: Session, name: str) -> User | None:
    return session.scalar(select(User).where(User.name == name))


def user_by_token(session: Session, token: str) -> User | None:
    return session.scalar(select(User).where(User.token_hash == hash_token(token)))
