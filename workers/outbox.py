"""What an attempt produced that the service has not taken yet: the worker-side buffer.

The training loop appends events (metrics, checkpoints) to a JSONL file in the attempt's
directory (EventTail reads what is new); its output lines, metrics, checkpoints and a script's
outputs wait in the Outbox until the API has them, so an API out of reach for a while loses
nothing. DroppedLines bounds the lines kept, and says where and why any were dropped.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_for
from dataclasses import dataclass, field
from pathlib import Path

from api_schemas.host_api import MAX_LINE_CHARS, RefusedTransfer
from api_schemas.worker_protocol import CheckpointEvent, InvalidSpecEvent, MetricsEvent, decode_events
from workers.host_client import ServiceRefused

log = logging.getLogger("trainyard.worker")

MAX_LOG_LINE = MAX_LINE_CHARS  # longer lines are cut
LINE_CHARS_PER_BATCH = 100_000  # a report's lines, at most: ≤ 600 KB however they are escaped, under the API's 1 MB
# Characters of lines waiting to be stored, at most: past it (printed faster than they can be stored,
# or the database out of reach) lines are dropped and counted, and the job's logs say how many, where.
MAX_PENDING_LOG_CHARS = 32 * 2**20
EVENTS_READ_BYTES = 16 * 2**20  # the most of the events file read at once


class EventTail:
    """Reads the events appended to the training loop's events file since the last read."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0
        self.skipped = 0  # lines that are no event: the file is the job's to write, whatever it writes

    def read(self) -> list[MetricsEvent | CheckpointEvent | InvalidSpecEvent]:
        # Not through a link (the file is the job's, and this process may read more than it), nor a
        # FIFO's open (it blocked this thread for good, the host's slot with it), and a bounded
        # read: a sparse file of gigabytes with no newline was read whole, every round.
        try:
            with open(os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    return []
                f.seek(self.offset)
                data = f.read(EVENTS_READ_BYTES)
        except OSError:
            return []
        if len(data) == EVENTS_READ_BYTES and b"\n" not in data:  # a line no event is ever this long
            self.offset += len(data)
            self.skipped += 1
            return []
        try:
            events, used = decode_events(data)  # a half-written last line waits for the next read
        except ValueError:  # some line is no event: the others are kept, line by line
            events, used = [], data.rfind(b"\n") + 1
            for line in data[:used].splitlines(keepends=True):
                try:
                    events += decode_events(line)[0]
                except ValueError:
                    self.skipped += 1
        self.offset += used
        return events


@dataclass
class Transfers:
    """Directories to take into the artifact store one at a time, oldest first, on the ingest
    threads (`take_in`, with no transaction open: a copy can take minutes), then to record in the
    database (`record`, in the sync's short transaction). A take still running after
    INGEST_WAIT_SECONDS is left for a later sync (unless it must `wait`); one that failed with
    `unfit` is skipped (retrying can't mend a missing or corrupt directory); a recording that
    failed (the API out of reach) keeps what was taken for the next sync."""

    items: list = field(default_factory=list)
    taking: Future | None = None  # the first item's take into the store
    taken: list[tuple] = field(default_factory=list)  # (item, what its take returned), not recorded yet
    refused: list[tuple] = field(default_factory=list)  # (item, why the store refused it), not reported yet
    last_refused: str | None = None  # why the latest item was refused, if it was

    def take_in(self, pool: ThreadPoolExecutor, take: Callable, unfit: type[Exception] | tuple, timeout: float | None) -> None:
        """Take items in, waiting at most `timeout` seconds for one still being taken (None: until it is)."""
        while self.items:
            if self.taking is None:
                self.taking = pool.submit(take, *self.items[0])
            if not wait_for([self.taking], timeout=timeout).done:
                return
            try:
                self.taken.append((self.items[0], self.taking.result()))
                self.last_refused = None
            except unfit as exc:
                log.warning("%s cannot be stored: %s", self.items[0][0], exc)
                self.refused.append((self.items[0], str(exc)))
                self.last_refused = str(exc)
            self.taking = None
            self.items.pop(0)

    def pending(self) -> bool:
        return bool(self.items or self.taken or self.refused)

    def ready(self) -> bool:
        """One to start taking in, or one taken in and not recorded yet (not one still being taken)."""
        return bool(self.taken or (self.items and (self.taking is None or self.taking.done())))

    def record(self, record: Callable) -> None:
        """`record` each item taken, oldest first. One the service refuses outright (ServiceRefused:
        sent again, refused again) is reported as refused, not retried while the attempt waits on
        it for ever; one it can't be reached for stays for the next sync."""
        while self.taken:
            item, taken = self.taken[0]
            try:
                record(*item, taken)
            except ServiceRefused as exc:
                log.warning("%s taken into the store but refused by the service: %s", item[0], exc)
                self.refused.append((item, f"the service refused to list it: {exc}"))
            self.taken.pop(0)


@dataclass
class Outbox:
    """What the attempt produced that the database has not stored yet."""

    metrics: list[tuple[int, str, float]] = field(default_factory=list)
    logs: list[tuple[int, int | None, str]] = field(default_factory=list)  # (seq, rank, line); add with add_line
    log_chars: int = 0  # of the lines in `logs`
    line_numbers: itertools.count = field(default_factory=itertools.count)  # each line's seq in the attempt
    checkpoints: Transfers = field(default_factory=Transfers)  # (directory, step, its folder in the store)
    outputs: Transfers = field(default_factory=Transfers)  # a script's (directory, name, step) to collect
    refused: list[RefusedTransfer] = field(default_factory=list)  # what the store refused, to report as events
    resending: bool = False  # a report's answer was lost: the next may hold what is stored already

    def empty(self) -> bool:
        return not (self.backlog() or self.checkpoints.pending() or self.outputs.pending())

    def waiting(self) -> int:
        """How many metric points, lines and refusals wait to be reported."""
        return len(self.metrics) + len(self.logs) + len(self.refused)

    def backlog(self) -> bool:
        """Metrics, lines or refusals wait to be reported."""
        return self.waiting() > 0

    def add_line(self, rank: int | None, line: str) -> None:
        line = line[:MAX_LOG_LINE]
        self.logs.append((next(self.line_numbers), rank, line))
        self.log_chars += len(line)

    def next_lines(self, count: int, chars: int = LINE_CHARS_PER_BATCH) -> list[tuple[int, int | None, str]]:
        """The first lines to report: at most `count`, and as many as fit in `chars` (at least one),
        so a report stays under the API's request size (1,000 lines of 4,000 characters were
        refused with 413, and sent again, for ever)."""
        taken = 0
        for taken, (_, _, line) in enumerate(self.logs[:count], start=1):
            chars -= len(line)
            if chars < 0 and taken > 1:
                return self.logs[:taken - 1]
        return self.logs[:taken]

    def drop_lines(self, count: int) -> None:
        """The first `count` lines are stored."""
        self.log_chars -= sum(len(line) for _, _, line in self.logs[:count])
        del self.logs[:count]


class DroppedLines:
    """Which output lines are stored: at most `budget` of an attempt (max_log_lines_per_attempt), and
    none while MAX_PENDING_LOG_CHARS wait to be stored already. A dropped line is counted, and the
    job's logs say when the budget is used up, and how many were dropped, where and why: never silently."""

    def __init__(self, budget: int):
        self.budget, self.kept, self.count, self.why = budget, 0, 0, ""

    def take(self, pending_chars: int) -> tuple[bool, list[str]]:
        """Whether to store the next line, with `pending_chars` waiting; and lines of the worker's to store before it."""
        if self.kept < self.budget and pending_chars < MAX_PENDING_LOG_CHARS:
            self.kept += 1
            return True, self.resumed()
        over_budget = self.kept >= self.budget
        why = (f"over the attempt's log budget of {self.budget:,} lines (max_log_lines_per_attempt)" if over_budget
               else f"printed faster than they could be stored ({MAX_PENDING_LOG_CHARS // 2**20} MiB of lines were waiting)")
        notes = []
        if why != self.why:
            notes = self.resumed()  # those dropped for the other reason
            if over_budget:
                notes.append(f"trainyard: {self.budget:,} lines stored, the attempt's log budget: later lines are dropped and counted")
            self.why = why
        self.count += 1
        return False, notes

    def resumed(self) -> list[str]:
        """The line saying how many were dropped since the last such line, if any were."""
        if not self.count:
            return []
        line, self.count = f"trainyard: {self.count:,} lines of output dropped here: {self.why}", 0
        return [line]
