"""Client.events against the real API app, served by uvicorn on SQLite."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.main import create_app
from service.db.accounts import user_by_name
from service.db.jobs import create_job
from service.db.session import session_factory
from tests.client.serve import serve_app
from tests.helpers import finish_job, job_spec, start_job
from trainyard.client import Client, TrainyardError


class CutFirstEventStream:
    """The real app, except that the first /events response breaks off after its first SSE message
    (a write may carry several: the rest of it is lost), as a dropped connection would. Records
    the Last-Event-ID of every /events request."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.last_event_ids: list[str | None] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/events"):
            return await self.app(scope, receive, send)
        last_event_id = dict(scope["headers"]).get(b"last-event-id")
        self.last_event_ids.append(last_event_id.decode() if last_event_id else None)
        if len(self.last_event_ids) > 1:
            return await self.app(scope, receive, send)

        async def send_one_message_then_break(message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                first, _, _ = message["body"].partition(b"\n\n")
                await send({**message, "body": first + b"\n\n", "more_body": True})
                raise ConnectionAbortedError("the connection drops")  # uvicorn closes it mid-response
            await send(message)

        await self.app(scope, receive, send_one_message_then_break)


@pytest.mark.timeout(60)
def test_events_follow_a_job_to_its_end_and_resume_a_dropped_stream_without_gaps_or_duplicates(settings, token):
    with session_factory(settings.resolved_database_url)() as session:
        job_id = create_job(session, user_by_name(session, "alice"), job_spec()).id
    claimed = start_job(settings, job_id)
    app = CutFirstEventStream(create_app(settings))
    with serve_app(app) as url, Client(url, token) as client, ThreadPoolExecutor(1) as background:
        events = client.events(job_id, retry_seconds=0.01)
        first = next(events)  # then the connection drops
        finishing = background.submit(finish_job, settings, claimed)  # the job ends while the client reconnects and follows
        rest = list(events)
        finishing.result()
    assert [(e.id, e.type.value) for e in [first, *rest]] == [
        (1, "status"), (2, "status"), (3, "status"), (4, "checkpoint"), (5, "metrics"), (6, "status"),
    ]
    assert rest[-1].data == {"status": "succeeded", "reason": None}
    assert app.last_event_ids == [None, "1"]


def test_events_of_a_job_that_is_not_there_fail_at_once(settings, token):
    with serve_app(create_app(settings)) as url, Client(url, token) as client:
        with pytest.raises(TrainyardError) as failure:
            list(client.events(999, retry_seconds=0.01))
    assert failure.value.status_code == 404
