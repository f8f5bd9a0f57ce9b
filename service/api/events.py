"""GET /v1/jobs/{id}/events: the job's event log as Server-Sent Events, polled from the database.

Each message carries a JobEventOut with the event's seq as its SSE id. A client that reconnects with
`Last-Event-ID: n` gets exactly the events after n (seq is gapless and in commit order, see
models.JobEvent). Once the job is final and every event is sent, an `end` message (no id) closes
the stream; a stream that stops without it was cut, and should be resumed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api_schemas import JobEventOut
from service.api.views import job_event_out
from service.db import crud

PAGE = 500
END = "event: end\ndata: {}\n\n"
HEARTBEAT = ": keep-alive\n\n"  # a comment: EventSource ignores it, proxies see traffic


async def job_event_stream(
    sessions: sessionmaker[Session], job_id: int, after: int, *, follow: bool, poll_seconds: float, heartbeat_seconds: float
) -> AsyncIterator[str]:
    """SSE messages of the job's events after seq `after`; without `follow`, only those there are now."""
    last_sent = time.monotonic()
    while True:
        # The database is read in a worker thread, so a waiting stream holds neither the event
        # loop nor a thread nor a pooled connection between polls.
        final, events = await run_in_threadpool(_poll, sessions, job_id, after)
        for event in events:
            yield f"id: {event.id}\nevent: {event.type.value}\ndata: {event.model_dump_json()}\n\n"
            after, last_sent = event.id, time.monotonic()
        if len(events) == PAGE:
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


def _poll(sessions: sessionmaker[Session], job_id: int, after: int) -> tuple[bool, list[JobEventOut]]:
    """(is the job final, its next events). The status is read first: a final status commits together
    with its event, so the events read after it include that one and all before it."""
    with sessions() as session:
        final = crud.job_status(session, job_id).is_final
        return final, [job_event_out(event) for event in crud.job_events_after(session, job_id, after, PAGE)]
