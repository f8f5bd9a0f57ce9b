"""Per-process limits that keep one client from crowding out the others: failed authentications
per client address, and open event streams per user. Both are counted in the API process's memory
(each API process keeps its own counts)."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter


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
