"""The FastAPI application. Imports no torch: the API starts fast on hosts without GPUs."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from api_schemas import field_location
from api_schemas.host_api import MAX_UPLOAD_PART_BYTES, is_upload_part
from service.admission import Refused
from service.api.events import Feeds
from service.api.limits import limits_for
from service.api.report_pacing import ReportPacing
from service.api.stream_tokens import StreamTokens
from service.api.audit import AuditTrail
from service.api.routes import audit, checkpoints, dashboard, host_api, host_transfers, jobs, login, monitoring, outputs, sweeps, teams, tokens, uploads, usage
from service.db.api_processes import beat_seconds, note_api_up
from service.db.doorbell import libpq_dsn
from service.db.models import utcnow
from service.db.session import read_session_factory, session_factory
from common.settings import Settings, get_settings

log = logging.getLogger("trainyard.api")


# Routes whose body is an uploaded file, allowed up to max_upload_bytes instead of max_request_bytes.
UPLOAD_PATHS = ("/v1/datasets", "/v1/code")


class BodySizeLimit:
    """Refuse request bodies over `max_bytes` (`max_upload_bytes` on the upload routes) with 413,
    whether or not Content-Length is declared."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_upload_bytes: int | None = None):
        self.app, self.max_bytes, self.max_upload_bytes = app, max_bytes, max_upload_bytes or max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_upload_bytes if scope["path"].rstrip("/") in UPLOAD_PATHS else self.max_bytes
        if scope["method"] == "PUT" and is_upload_part(scope["path"]):
            limit = MAX_UPLOAD_PART_BYTES
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await self._too_large(scope, receive, send, limit)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._too_large(scope, receive, send, limit)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = JSONResponse({"detail": f"request body larger than {limit} bytes"}, status_code=413)
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


class UnexpectedErrors:
    """An exception no route meant to raise is the server's fault, never the caller's: it gets a 500
    whose body and X-Request-ID header carry a new request id, and its traceback is logged once
    under that id, so that a user's report leads to the log line."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception:
            request_id = uuid.uuid4().hex
            log.exception(
                "unexpected error answering %s %s (request id %s)", scope["method"], scope["path"], request_id, extra={"request_id": request_id}
            )
            if started:  # too late for a 500: the server cuts the answer short, and the log has already said why
                return
            body = {"detail": "internal error", "request_id": request_id}
            await JSONResponse(body, status_code=500, headers={"X-Request-ID": request_id})(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    # FastAPIOffline: FastAPI whose /docs and /redoc pages load their scripts from the API itself, not a CDN.
    app = FastAPIOffline(title="Trainyard", version="0.1.0", description="Runs distributed PyTorch training jobs.", lifespan=_noting_it_is_up)
    app.state.settings = settings
    app.state.failed_auths, app.state.stream_slots = limits_for(
        settings.resolved_broker_url, settings.max_failed_auths_per_minute, settings.max_streams_per_user
    )
    database_url = settings.resolved_database_url
    app.state.stream_tokens = StreamTokens(read_session_factory(database_url))  # a followed stream ends when its token stops working
    app.state.report_pacing = ReportPacing(read_session_factory(database_url), settings.api_reports_per_second)
    app.state.feeds = Feeds(read_session_factory(database_url), settings.events_poll_seconds, listen_dsn=libpq_dsn(database_url))
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes, max_upload_bytes=settings.max_upload_bytes)
    app.add_middleware(AuditTrail, sessions=session_factory(database_url))  # a refused body is audited too
    app.add_middleware(UnexpectedErrors)  # added last, so outermost: it sees what BodySizeLimit lets through
    # The worker protocol first: routes are matched in order, and its requests are most of them (a
    # heartbeat or a report from every host every few seconds).
    app.include_router(host_api.router)
    app.include_router(host_transfers.router)
    app.include_router(jobs.router)
    app.include_router(checkpoints.router)
    app.include_router(outputs.router)
    app.include_router(sweeps.router)
    app.include_router(uploads.datasets)
    app.include_router(uploads.code)
    app.include_router(tokens.router)
    app.include_router(login.router)
    app.include_router(audit.router)
    app.include_router(usage.router)
    app.include_router(teams.router)
    app.include_router(dashboard.router)
    app.include_router(dashboard.page_router)
    app.mount("/static", StaticFiles(directory=dashboard.STATIC_DIR), name="static")
    app.include_router(monitoring.router)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:  # on the event loop: it answers even while the thread pool is busy
        return {"status": "ok"}

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422, with each location as the user knows the field (`body.dataset.path`).
        errors = [{**error, "loc": field_location(error["loc"])} for error in exc.errors()]
        # A body that isn't UTF-8 is echoed as its bytes: decoded with replacements, not left to fail (a 500).
        echoed = jsonable_encoder(errors, custom_encoder={bytes: lambda data: data.decode(errors="replace")})
        return JSONResponse({"detail": finite(echoed)}, status_code=422)

    @app.exception_handler(Refused)
    async def _refused(_request: Request, exc: Refused) -> JSONResponse:
        # The shapes clients know: a bad field as in FastAPI's own 422, a quota with its numbers.
        if exc.field is not None:
            detail = [{"loc": ["body", *exc.field], "msg": exc.message, "type": "value_error"}]
        else:
            detail = {"msg": exc.message, **exc.facts} if exc.facts else exc.message
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
        return JSONResponse({"detail": detail}, status_code=exc.status, headers=headers)

    return app


@asynccontextmanager
async def _noting_it_is_up(app: FastAPI):
    """While the app serves, it notes every beat that this API process is up: the scheduler judges
    leases only while hosts could renew them (service/db/api_processes.py)."""
    noting = asyncio.create_task(_note_up_forever(app.state.settings))
    try:
        yield
    finally:
        noting.cancel()


async def _note_up_forever(settings: Settings) -> None:
    sessions, name = session_factory(settings.resolved_database_url), f"{socket.gethostname()}:{os.getpid()}"
    beat = beat_seconds(settings.lease_seconds)

    def note() -> None:
        with sessions() as session:
            note_api_up(session, name, utcnow(), beat)

    failing = False
    while True:
        try:
            # Not on the request threads: a busy API still says it is up.
            await asyncio.to_thread(note)
            failing = False
        except Exception:  # the database out of reach: the note after it starts a new "up since"
            # Said once a streak: meanwhile the scheduler judges no lease lost.
            log.log(logging.DEBUG if failing else logging.WARNING, "could not note that this API process is up", exc_info=True)
            failing = True
        await asyncio.sleep(beat)


def finite(value):
    """`value` with each NaN or infinite number as its name: a 422 echoes the input it refused, and a
    `NaN` in a body (Python's json reads it) is no JSON to answer with."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite(item) for item in value]
    return value
