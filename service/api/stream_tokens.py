"""Whether the token an open stream was started with still works.

A request is authenticated once, when it starts; a followed /events or /logs stream may stay open
for days. So a stream asks again every CHECK_SECONDS, and ends (without its `end` message: the
client reconnects, and its token is refused with 401 saying why) once its token was rotated,
revoked or has expired. One read answers for every stream of the same token in this process
within CHECK_SECONDS: hundreds of followers of one user cost one query every few seconds.
"""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.db.accounts import why_refused
from service.db.models import User, utcnow

CHECK_SECONDS = 2.0


class StreamTokens:
    def __init__(self, sessions: sessionmaker[Session], check_seconds: float = CHECK_SECONDS):
        self.sessions, self.check_seconds = sessions, check_seconds
        self._checked: dict[tuple[int, str], tuple[float, bool]] = {}  # (user id, token hash) -> (when, still works)

    async def still_works(self, user: User) -> bool:
        """Whether `user`'s token as presented (its hash, read when the stream started) works now."""
        key = (user.id, user.token_hash)
        checked = self._checked.get(key)
        if checked is None or time.monotonic() - checked[0] >= self.check_seconds:
            works = await run_in_threadpool(self._read, *key)
            checked = self._checked[key] = (time.monotonic(), works)
            self._forget_old()
        return checked[1]

    def _read(self, user_id: int, token_hash: str) -> bool:
        with self.sessions() as session:
            now = session.scalar(select(User).where(User.id == user_id, User.token_hash == token_hash))
            return now is not None and why_refused(now, utcnow()) is None

    def _forget_old(self) -> None:
        expired = time.monotonic() - 10 * self.check_seconds
        for key in [key for key, (when, _) in self._checked.items() if when < expired]:
            del self._checked[key]
