"""Server-Sent Events polled from the database: a job's event log (GET /v1/jobs/{id}/events) and
its output (GET /v1/jobs/{id}/logs?follow=true).

Each message carries one item as JSON with the item's position as its SSE id: the event's seq, or
the log line's id. A client that reconnects with `Last-Event-ID: n` (or, for logs, `cursor=n`)
gets exactly the items after n, since both are numbered in commit order. Once the job is final and
every item is sent, an `end` message (no id) closes the stream; a stream that stops without it was
cut, and should be resumed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.api.views import job_event_out, log_line_out
from service.db.jobs import job_events_after, job_status
from service.db.log_lines import log_lines_after

PAGE = 500
END = "event: end\ndata: {}\n\n"
HEARTBEAT = ": keep-alive\n\n"  # a comment: EventSource ignores it, proxies see traffic

# (is the job final, its next (id, SSE event name, JSON) items after an id): one page, oldest first.
Poll = Callable[[int], tuple[bool, list[tuple[int, str, str]]]]


async def polled_stream(poll: Poll, after: int, *, follow: bool, poll_seconds: float, heartbeat_seconds: float) -> AsyncIterator[str]:
    """SSE messages of the items after `after`; without `follow`, only those there are now."""
    last_sent = time.monotonic()
    while True:
        # The database is read in a worker thread, so a waiting stream holds neither the event
        # loop nor a thread nor a pooled connection between polls.
        final, items = await run_in_threadpool(poll, after)
        for item_id, name, data in items:
            yield f"id: {item_id}\nevent: {name}\ndata: {data}\n\n"
            after, last_sent = item_id, time.monotonic()
        if len(items) == PAGE:
            continue
        if final:
            yield END
            return
        if not follow:
            return
        if time.monotonic() - last_sent >= heartbeat_seconds:
            yield HEARTBEAT
            last_sent = time.monotonic()
        await asyncio.sleep(poll_seconds)


# The status is read before the items in both polls: a final status commits together with (events)
# or after (log lines: the worker stores its output before it ends the attempt) the last items, so
# the items read after a final status include the last ones.

def job_events(sessions: sessionmaker[Session], job_id: int) -> Poll:
    def poll(after: int) -> tuple[bool, list[tuple[int, str, str]]]:
        with sessions() as session:
            final = job_status(session, job_id).is_final
            events = [job_event_out(event) for event in job_events_after(session, job_id, after, PAGE)]
        return final, [(event.id, event.type.value, event.model_dump_json()) for event in events]

    return poll


def job_log_lines(sessions: sessionmaker[Session], job_id: int, rank: int | None) -> Poll:
    def poll(after: int) -> tuple[bool, list[tuple[int, str, str]]]:
        with sessions() as session:
            final = job_status(session, job_id).is_final
            lines = log_lines_after(session, job_id, after, PAGE, rank)
            out = [(line.id, log_line_out(line)) for line in lines]
        return final, [(line_id, "line", line.model_dump_json()) for line_id, line in out]

    return poll
