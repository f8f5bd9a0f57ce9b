"""Server-Sent Events of a job's event log (GET /v1/jobs/{id}/events) and of its output
(GET /v1/jobs/{id}/logs?follow=true), fanned out to any number of followers.

Each message carries one item as JSON with the item's position as its SSE id: the event's seq, or
the log line's id. A client that reconnects with `Last-Event-ID: n` (or, for logs, `cursor=n`)
gets exactly the items after n, since both are numbered in commit order. Once the job is final and
every item is sent, an `end` message (no id) closes the stream; a stream that stops without it was
cut, and should be resumed.

Per API process, one watcher per followed job and kind (a task on the event loop) reads what is
new, in one short read transaction, however many follow it, and hands each follower the batch. On
PostgreSQL it reads when told: writers NOTIFY the job's id as they commit (db/doorbell.py
`tell_followers`), heard by one LISTEN connection per API process (JobItemsListener), with a read
every FALLBACK_READ_SECONDS anyway for a notice missed while that connection was down. On SQLite
it reads every `events_poll_seconds`.

A follower waiting for the next batch is a coroutine parked on its queue: no thread, no
connection. It first catches up from the database, page by page, a few followers at a time; its
queue holds at most QUEUE_BATCHES batches, and a follower that falls that far behind (its client
reads slowly) stops receiving batches and catches up from the database again, at its own pace,
instead of being buffered for. A client that reads nothing for SEND_TIMEOUT_SECONDS is dropped (it
resumes with Last-Event-ID). A followed stream whose token stops working (rotated, revoked,
expired) ends within seconds (service/api/stream_tokens.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import cached_property

import psycopg
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from service.api.views import job_event_out, log_line_out
from service.db.doorbell import FOLLOWERS_CHANNEL
from service.db.jobs import job_events_after, job_status, last_event_seq
from service.db.log_lines import last_log_line_id, log_lines_after

log = logging.getLogger("trainyard.api")

PAGE = 500
QUEUE_BATCHES = 64  # batches one follower may have waiting before it is made to catch up from the database
CATCH_UPS_AT_ONCE = 4  # followers reading history at once, per process (each holds a thread and a connection meanwhile)
SEND_TIMEOUT_SECONDS = 60.0  # a client that takes no bytes for this long is dropped
FALLBACK_READ_SECONDS = 5.0  # with NOTIFY: how long a watcher waits for one before it reads anyway
END = "event: end\ndata: {}\n\n"
HEARTBEAT = ": keep-alive\n\n"  # a comment: EventSource ignores it, proxies see traffic


async def _always() -> bool:
    return True


@dataclass(frozen=True)
class Item:
    id: int
    event: str  # the SSE event name
    data: str  # JSON
    rank: int | None = None  # a log line's rank, for followers of one rank

    @cached_property  # once, however many followers send it
    def message(self) -> str:
        return f"id: {self.id}\nevent: {self.event}\ndata: {self.data}\n\n"


@dataclass(frozen=True)
class Source:
    """What a stream reads: `page(session, job_id, after, limit, rank)` (oldest first) and
    `last_id(session, job_id)`."""

    kind: str
    page: Callable[[Session, int, int, int, int | None], list[Item]]
    last_id: Callable[[Session, int], int]


def _event_page(session: Session, job_id: int, after: int, limit: int, _rank: int | None) -> list[Item]:
    events = [job_event_out(event) for event in job_events_after(session, job_id, after, limit)]
    return [Item(event.id, event.type.value, event.model_dump_json()) for event in events]


def _log_page(session: Session, job_id: int, after: int, limit: int, rank: int | None) -> list[Item]:
    return [
        Item(line.id, "line", log_line_out(line).model_dump_json(), line.rank)
        for line in log_lines_after(session, job_id, after, limit, rank)
    ]


EVENTS = Source("events", _event_page, last_event_seq)
LOG_LINES = Source("logs", _log_page, last_log_line_id)


def _read(sessions: sessionmaker[Session], source: Source, job_id: int, after: int, rank: int | None) -> tuple[bool, list[Item]]:
    """(is the job final, one page of its items after `after`). The status is read first: a final
    status commits together with (events) or after (log lines: the worker stores its output before
    it ends the attempt) the last items, so the items read after a final status include the last ones."""
    with sessions() as session:
        final = job_status(session, job_id).is_final
        return final, source.page(session, job_id, after, PAGE, rank)


class _Follower:
    def __init__(self, after: int, rank: int | None):
        self.after, self.rank = after, rank
        self.batches: asyncio.Queue[tuple[list[Item], bool]] = asyncio.Queue(QUEUE_BATCHES)
        self.behind = False  # batches were left out: catch up from the database

    def offer(self, items: list[Item], final: bool) -> None:
        if self.behind:
            return
        try:
            self.batches.put_nowait((items, final))
        except asyncio.QueueFull:
            self.behind = True


class _Watcher:
    """The one reader of one job's items of one kind in this process, while anyone follows them."""

    def __init__(self, feeds: Feeds, source: Source, job_id: int):
        self.feeds, self.source, self.job_id = feeds, source, job_id
        self.followers: set[_Follower] = set()
        self.started = asyncio.Event()  # its position is known: followers catch up after this
        self.told = asyncio.Event()  # a NOTIFY said the job has new items
        self.task = asyncio.create_task(self._watch())

    async def _until_next_read(self) -> None:
        """Until a NOTIFY tells of new items (or the listener connects), or the poll's time."""
        listening = self.feeds.listener is not None and self.feeds.listener.listening
        try:
            await asyncio.wait_for(self.told.wait(), FALLBACK_READ_SECONDS if listening else self.feeds.poll_seconds)
        except TimeoutError:
            pass
        self.told.clear()  # before the read: a notice during it makes the next wait return at once

    async def _watch(self) -> None:
        after = None
        final = False
        while not final:
            try:
                if after is None:
                    after = await run_in_threadpool(_last_id, self.feeds.sessions, self.source, self.job_id)
                    self.started.set()
                await self._until_next_read()
                while True:
                    final, items = await run_in_threadpool(_read, self.feeds.sessions, self.source, self.job_id, after, None)
                    ended = final and len(items) < PAGE
                    if items or ended:
                        after = items[-1].id if items else after
                        for follower in self.followers:
                            follower.offer(items, ended)
                    if len(items) < PAGE:
                        break
            except Exception:  # the database away for a moment: read on from where it was
                log.warning("job %s %s watcher: reading failed; trying again", self.job_id, self.source.kind, exc_info=True)
                await asyncio.sleep(self.feeds.poll_seconds)


def _last_id(sessions: sessionmaker[Session], source: Source, job_id: int) -> int:
    with sessions() as session:
        return source.last_id(session, job_id)


class JobItemsListener:
    """This API process's one LISTEN connection (PostgreSQL): each notice wakes the watchers of its
    job. Reconnects while it runs; `listening` says whether notices are heard now."""

    def __init__(self, dsn: str, feeds: Feeds):
        self.dsn, self.feeds = dsn, feeds
        self.listening = False
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as connection:
                    await connection.execute(f"LISTEN {FOLLOWERS_CHANNEL}")
                    self.listening = True
                    self.feeds.tell_all()  # whatever was committed while nobody listened
                    async for notice in connection.notifies():
                        self.feeds.tell(int(notice.payload))
            except (psycopg.Error, OSError, ValueError):
                log.warning("listening for new job items failed; watchers poll meanwhile", exc_info=True)
            self.listening = False
            await asyncio.sleep(1.0)


class Feeds:
    """The watchers of this API process, and the streams their followers read."""

    def __init__(self, sessions: sessionmaker[Session], poll_seconds: float, listen_dsn: str | None = None):
        self.sessions, self.poll_seconds = sessions, poll_seconds
        self.watchers: dict[tuple[str, int], _Watcher] = {}
        self._catch_ups = asyncio.Semaphore(CATCH_UPS_AT_ONCE)
        self.listener = JobItemsListener(listen_dsn, self) if listen_dsn else None
        # The process is stopping: followed streams end (without END) within recheck_seconds, and
        # their clients resume on another process with Last-Event-ID. Else a stop waited for every
        # followed job to end, and a rolling restart hung until it was killed.
        self.closing = False

    def tell(self, job_id: int) -> None:
        for source in (EVENTS, LOG_LINES):
            if (watcher := self.watchers.get((source.kind, job_id))) is not None:
                watcher.told.set()

    def tell_all(self) -> None:
        for watcher in self.watchers.values():
            watcher.told.set()

    async def stream(
        self, source: Source, job_id: int, after: int, *, rank: int | None = None, follow: bool, heartbeat_seconds: float,
        allowed: Callable[[], Awaitable[bool]] = _always, recheck_seconds: float = 2.0,
    ) -> AsyncIterator[str]:
        """SSE messages of the items after `after`; without `follow`, only those there are now.
        A followed stream asks `allowed` at least every `recheck_seconds` and ends, without END, once
        it says no (its token no longer works: the client's reconnection is told why)."""
        follower = _Follower(after, rank)
        if not follow:
            async for message in self._catch_up(source, job_id, follower):
                yield message
            return
        key = (source.kind, job_id)
        if self.listener is not None:
            self.listener.start()
        watcher = self.watchers.get(key)
        if watcher is None:
            watcher = self.watchers[key] = _Watcher(self, source, job_id)
        watcher.followers.add(follower)
        try:
            await watcher.started.wait()
            while not self.closing and await allowed():
                follower.behind = False
                while not follower.batches.empty():  # all of it is in the database: read it there
                    follower.batches.get_nowait()
                async for message in self._catch_up(source, job_id, follower):
                    yield message
                    if message is END:
                        return
                quiet_since = time.monotonic()
                while not follower.behind:
                    if self.closing or not await allowed():
                        return
                    try:
                        items, final = await asyncio.wait_for(follower.batches.get(), min(heartbeat_seconds, recheck_seconds))
                    except TimeoutError:
                        if time.monotonic() - quiet_since >= heartbeat_seconds:
                            yield HEARTBEAT
                            quiet_since = time.monotonic()
                        continue
                    quiet_since = time.monotonic()
                    # The batch's messages as one write: one send through the ASGI stack per batch, not per item.
                    fresh = [item for item in items if item.id > follower.after and (rank is None or item.rank == rank)]
                    if fresh:
                        yield "".join(item.message for item in fresh)
                        follower.after = fresh[-1].id
                    if final:
                        yield END
                        return
        finally:
            watcher.followers.discard(follower)
            if not watcher.followers:  # the last one gone: so is its watcher
                watcher.task.cancel()
                if self.watchers.get(key) is watcher:
                    del self.watchers[key]

    async def _catch_up(self, source: Source, job_id: int, follower: _Follower) -> AsyncIterator[str]:
        """The stored items after the follower's position, page by page, then END if the job is final."""
        while True:
            async with self._catch_ups:
                final, items = await run_in_threadpool(_read, self.sessions, source, job_id, follower.after, follower.rank)
            if items:
                yield "".join(item.message for item in items)
                follower.after = items[-1].id
            if len(items) < PAGE:
                if final:
                    yield END
                return


class EventStreamResponse(StreamingResponse):
    """An SSE response that runs `on_close` when it ends, however it ends, and drops a client that
    takes no bytes for SEND_TIMEOUT_SECONDS (its connection is closed; it resumes with Last-Event-ID)."""

    def __init__(self, messages: AsyncIterator[str], on_close: Callable[[], None] = lambda: None):
        # no-cache and X-Accel-Buffering: proxies must pass each message on as it comes.
        super().__init__(messages, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def send_or_give_up(message) -> None:
            async with asyncio.timeout(SEND_TIMEOUT_SECONDS):  # no task per message, as wait_for makes
                await send(message)

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except TimeoutError:
            log.info("dropped an event stream whose client read nothing for %s s", SEND_TIMEOUT_SECONDS)
        finally:
            self.on_close()
