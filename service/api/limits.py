"""Limits that keep one client from crowding out the others: failed authentications per client
address, and open event streams per user. With the Redis broker (production: several API processes
behind nginx) they are counted in Redis, across every API process; on the embedded stack (one API
process) in its memory. `limits_for` picks."""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import Counter

log = logging.getLogger("trainyard.api")


class FailedAuthLimiter:
    """At most `max_failures` wrong tokens per client address in a fixed window of `window_seconds`;
    past that, the address is refused until its window ends. A missing token is no guess and is not
    counted."""

    def __init__(self, max_failures: int, window_seconds: float = 60.0):
        self.max_failures, self.window_seconds = max_failures, window_seconds
        self._windows: dict[str, tuple[float, int]] = {}  # address: (window start, failures in it)
        self._lock = threading.Lock()  # called from the thread pool's threads

    def retry_after(self, address: str) -> int | None:
        """Seconds until `address` may try again; None if it may now."""
        with self._lock:
            start, failures = self._windows.get(address, (0.0, 0))
            left = start + self.window_seconds - time.monotonic()
            return math.ceil(left) if failures >= self.max_failures and left > 0 else None

    def failed(self, address: str) -> None:
        now = time.monotonic()
        with self._lock:
            start, failures = self._windows.get(address, (now, 0))
            if now - start >= self.window_seconds:
                start, failures = now, 0
            self._windows[address] = (start, failures + 1)
            if len(self._windows) > 10_000:  # many addresses: forget those whose window is over
                self._windows = {a: w for a, w in self._windows.items() if now - w[0] < self.window_seconds}


class TooManyStreams(Exception):
    pass


class StreamSlots:
    """At most `per_user` open event streams (followed events or logs) per user."""

    def __init__(self, per_user: int):
        self.per_user = per_user
        self._open: Counter[int] = Counter()
        self._lock = threading.Lock()

    def take(self, user_id: int) -> None:
        """Take a slot, or raise TooManyStreams; give it back with give_back."""
        with self._lock:
            if self._open[user_id] >= self.per_user:
                raise TooManyStreams(f"{self.per_user} streams are open for this user already; close one first")
            self._open[user_id] += 1

    def give_back(self, user_id: int) -> None:
        with self._lock:
            self._open[user_id] -= 1
            if not self._open[user_id]:
                del self._open[user_id]


# -- across API processes, in Redis ------------------------------------------------------------------

KEY_PREFIX = "trainyard:limits:"


class SharedFailedAuthLimiter:
    """FailedAuthLimiter's rule counted in Redis: a client's wrong tokens count toward one limit,
    whichever API process they reach. A window starts at the first failure and its key expires with it.
    If Redis can't be reached, nobody is refused for it (the database still checks every token)."""

    def __init__(self, redis, max_failures: int, window_seconds: float = 60.0):
        self.redis, self.max_failures, self.window_seconds = redis, max_failures, window_seconds

    def retry_after(self, address: str) -> int | None:
        key = f"{KEY_PREFIX}auth-failures:{address}"
        try:
            failures, left = self.redis.pipeline().get(key).pttl(key).execute()
        except Exception as exc:  # redis.RedisError, or the connection's own
            log.warning("failed-auth limit not checked: Redis unreachable (%s)", exc)
            return None
        if failures is None or int(failures) < self.max_failures or left <= 0:
            return None
        return math.ceil(left / 1000)

    def failed(self, address: str) -> None:
        key = f"{KEY_PREFIX}auth-failures:{address}"
        try:
            self.redis.pipeline().incr(key).expire(key, math.ceil(self.window_seconds), nx=True).execute()
        except Exception as exc:
            log.warning("failed authentication not counted: Redis unreachable (%s)", exc)


# Take a slot atomically: drop the expired (their API process died without giving them back), then
# add ours if the user has fewer than the limit. KEYS[1]: the user's set; ARGV: now, expired-before,
# limit, stream id.
_TAKE_SLOT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
redis.call('EXPIRE', KEYS[1], 3600)
return 1
"""


class SharedStreamSlots:
    """StreamSlots counted in Redis, across API processes: each open stream is a member of its user's
    sorted set, scored by when its process last said it is still open (every REFRESH_SECONDS); one
    not refreshed for EXPIRE_SECONDS (its process died) no longer counts. If Redis can't be
    reached, streams are not limited (and say so in the log) rather than refused."""

    REFRESH_SECONDS, EXPIRE_SECONDS = 20.0, 60.0

    def __init__(self, redis, per_user: int):
        self.redis, self.per_user = redis, per_user
        self._take = redis.register_script(_TAKE_SLOT)
        self._mine: dict[int, list[str]] = {}  # user id: this process's open streams' ids
        self._lock = threading.Lock()
        threading.Thread(target=self._refresh, name="stream-slots", daemon=True).start()

    def take(self, user_id: int) -> None:
        stream = uuid.uuid4().hex
        now = time.time()
        try:
            taken = self._take(keys=[f"{KEY_PREFIX}streams:{user_id}"], args=[now, now - self.EXPIRE_SECONDS, self.per_user, stream])
        except Exception as exc:
            log.warning("stream not counted: Redis unreachable (%s)", exc)
            taken = True
        if not taken:
            raise TooManyStreams(f"{self.per_user} streams are open for this user already; close one first")
        with self._lock:
            self._mine.setdefault(user_id, []).append(stream)

    def give_back(self, user_id: int) -> None:
        with self._lock:
            stream = self._mine[user_id].pop()
            if not self._mine[user_id]:
                del self._mine[user_id]
        try:
            self.redis.zrem(f"{KEY_PREFIX}streams:{user_id}", stream)
        except Exception as exc:
            log.warning("stream slot not given back (it expires in %g s): Redis unreachable (%s)", self.EXPIRE_SECONDS, exc)

    def _refresh(self) -> None:
        while True:
            time.sleep(self.REFRESH_SECONDS)
            with self._lock:
                mine = {user: list(streams) for user, streams in self._mine.items()}
            try:
                pipe = self.redis.pipeline()
                for user, streams in mine.items():
                    pipe.zadd(f"{KEY_PREFIX}streams:{user}", {stream: time.time() for stream in streams}, xx=True)
                pipe.execute()
            except Exception as exc:
                log.warning("open streams not refreshed: Redis unreachable (%s)", exc)


def limits_for(broker_url: str, max_failed_auths_per_minute: int, max_streams_per_user: int):
    """(failed-auth limiter, stream slots): in Redis if the broker is Redis, else in this process."""
    if broker_url.startswith(("redis://", "rediss://")):
        import redis

        client = redis.Redis.from_url(broker_url, socket_timeout=2, socket_connect_timeout=2)
        return SharedFailedAuthLimiter(client, max_failed_auths_per_minute), SharedStreamSlots(client, max_streams_per_user)
    return FailedAuthLimiter(max_failed_auths_per_minute), StreamSlots(max_streams_per_user)
