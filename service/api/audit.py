"""The audit trail's writer: every mutating request, once answered, becomes an AuditEntry (who,
what, when, from where, and the answer), so an admin can see who submitted which code job and
who cancelled what, failed attempts included.

Routes say what they did with `note()` (the job a submit created); the authentication dependency
leaves the caller on the request's state. The row is written in a short transaction of its own
after the response is sent, in a thread, so no request waits for it.
"""

from __future__ import annotations

import logging
import re

import anyio.to_thread
from fastapi import Request
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_schemas import JobSpec
from api_schemas.host_api import HOST_API_PREFIX
from service.db.audit import record

log = logging.getLogger("trainyard.api")

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JOB_PATH = re.compile(r"^/v1/jobs/(\d{1,18})(/|$)")


def note(request: Request, *, job_id: int | None = None, detail: str | None = None) -> None:
    """What this request did, for its audit entry."""
    request.state.audit = (job_id, detail)


def describe(spec: JobSpec) -> str:
    """A job in words, naming the code it runs: `script job (train.py)`, `custom job (gan:train)`, `gpt job`."""
    if spec.script is not None:
        return f"script job ({spec.script.entrypoint})"
    if spec.model is not None and spec.model.kind == "custom":
        return f"custom job ({spec.model.entrypoint})"
    return f"{spec.model.kind if spec.model else 'built-in'} job"


class AuditTrail:
    def __init__(self, app: ASGIApp, sessions: sessionmaker[Session]):
        self.app, self.sessions = app, sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The worker protocol is machines' traffic (a report per attempt every few seconds), not a user's act.
        if scope["type"] != "http" or scope["method"] not in MUTATING or scope["path"].startswith(HOST_API_PREFIX):
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})  # the same dict as every Request's `.state` for this scope
        status_code = 500  # unless a response starts: an exception escaped

        async def watched_send(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        finally:
            caller = state.get("caller")
            job_id, detail = state.get("audit", (None, None))
            if job_id is None and (named := JOB_PATH.match(scope["path"])):  # refused before its route ran
                job_id = int(named.group(1))
            entry = dict(
                user_id=caller.id if caller else None,
                user_name=caller.name if caller else None,
                client_address=(scope.get("client") or ("",))[0][:100],
                method=scope["method"],
                path=scope["path"][:500],
                status_code=status_code,
                job_id=job_id,
                detail=detail[:500] if detail else None,
            )
            with anyio.CancelScope(shield=True):  # a client that hung up is still audited
                await anyio.to_thread.run_sync(self._write, entry)

    def _write(self, entry: dict) -> None:
        try:
            with self.sessions() as session:
                record(session, **entry)
        except Exception:  # the request was answered; losing its audit line must not look like its failure
            log.exception("could not write the audit entry for %s %s", entry["method"], entry["path"])
