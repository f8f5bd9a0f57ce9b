"""Dependencies shared by the routes: settings, DB sessions, the authenticated user, the artifact store.

No dependency holds a database connection past its route's function: the caller is authenticated in
a transaction of its own, closed before the route runs (an upload's body then streams in, a
download's bytes stream out, with no transaction open), and a route's sessions close in the route's
own thread as it returns (SessionsEndWithRoute), before its response is validated and sent.
"""

from __future__ import annotations

import functools
from datetime import datetime, timezone
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Query, Request, status
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api_schemas import ErrorOut
from service.api.limits import FailedAuthLimiter
from common.artifacts import ArtifactStore
from service.db.accounts import user_by_token, why_refused
from service.db.browser_logins import SESSION_PREFIX, user_by_browser_token
from service.db.host_tokens import host_by_token
from service.db.jobs import job_visible_to
from service.db.models import Job, User, utcnow
from service.db.session import read_session_factory, session_factory
from common.settings import Settings


# Error responses for the OpenAPI schema, so clients (and schemathesis) know every status a route gives.
NEEDS_TOKEN = {
    401: {"model": ErrorOut, "description": "Missing or invalid bearer token."},
    429: {"description": "Too many failed authentications from this client address lately (see Retry-After), or a route's own limit."},
}
MAY_BE_MISSING = {404: {"model": ErrorOut, "description": "No such item, or not yours."}}


async def get_settings(request: Request) -> Settings:
    # async: FastAPI runs a sync dependency on its thread pool, a round trip through the event loop
    # for every request just to read an attribute.
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


async def get_session(settings: SettingsDep) -> AsyncIterator[Session]:
    async for session in _session_of(read_session_factory(settings.resolved_database_url)):
        yield session


async def get_write_session(settings: SettingsDep) -> AsyncIterator[Session]:
    async for session in _session_of(session_factory(settings.resolved_database_url)):
        yield session


async def _session_of(sessions: sessionmaker[Session]) -> AsyncIterator[Session]:
    # async: a new session touches no database, and a sync generator dependency costs two trips
    # through the thread pool per request. Closing it is I/O only while it still holds a connection
    # (a route not of SessionsEndWithRoute): then it is closed on the pool, never on the event loop.
    session = sessions()
    try:
        yield session
    finally:
        if session.in_transaction():
            await run_in_threadpool(session.close)
        else:
            session.close()


# scope="function": closed when the route returns, not after its response (a stream, a slow client) is sent.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]  # reads only
WriteSessionDep = Annotated[Session, Depends(get_write_session, scope="function")]


class SessionsEndWithRoute(APIRoute):
    """A route whose (sync) function closes the sessions it was given before it returns, in its
    own thread. FastAPI ends function-scoped dependencies only after it has validated the response,
    which for a sync route waits for a thread of the pool: with every thread waiting for a database
    connection and every connection held by a request waiting for a thread, nothing moves until the
    pool's timeout (500s; on SQLite, a held write lock stalls every process). What a route returns
    is built by then (an `…Out` model), so nothing needs the session afterwards."""

    def __init__(self, path: str, endpoint: Callable, **kwargs):
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _closing_sessions(endpoint)
        super().__init__(path, endpoint, **kwargs)


def _closing_sessions(endpoint: Callable) -> Callable:
    @functools.wraps(endpoint)  # the same signature: FastAPI reads the parameters through it
    def run(*args, **kwargs):
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()

    return run


_bearer = HTTPBearer(auto_error=False)
BearerCredentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _token_owner(request: Request, settings: Settings, credentials: HTTPAuthorizationCredentials | None, lookup: Callable):
    """Whose the bearer token is, by `lookup(session, token)`, read in a short transaction of its own;
    None for no token or a wrong one, once `refuse_a_guesser` has let it through."""
    owner = None
    if credentials:
        with read_session_factory(settings.resolved_database_url)() as session:
            owner = lookup(session, credentials.credentials)
    if owner is None:
        refuse_a_guesser(request, guessed=credentials is not None)
    return owner


def refuse_a_guesser(request: Request, guessed: bool) -> None:
    """For a request that did not authenticate (no token, a wrong one, a wrong login code): 429 if
    its client address sent too many wrong credentials lately; else a wrong one (`guessed`) is
    counted against the address, and the caller answers 401. A right credential is served whatever
    else came from its address: the embedded stack's clients all share 127.0.0.1, and a user's loop
    with a mistyped token had the worker hosts' reports refused and their attempts lost. Every
    credential is a random secret of 192 bits or more, which no rate of guessing finds."""
    limiter: FailedAuthLimiter = request.app.state.failed_auths
    address = request.client.host if request.client else ""
    if retry_after := limiter.retry_after(address):
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS, "too many failed authentications from this address", headers={"Retry-After": str(retry_after)}
        )
    if guessed:
        limiter.failed(address)


def get_current_user(
    request: Request, settings: SettingsDep, credentials: BearerCredentials
) -> User:
    """The token's user (detached, its columns loaded)."""
    user = _token_owner(request, settings, credentials, _user_by_token)
    if user is None:
        raise _unauthorized("missing or invalid bearer token")
    request.state.caller = user  # for the audit trail (service/api/audit.py), a refused token's owner too
    if refused := why_refused(user, utcnow()):  # a real token, so not counted as a guess
        raise _unauthorized(refused)
    return user


def _user_by_token(session: Session, token: str) -> User | None:
    """A user's own token, or a browser session's that acts as its user (service/db/browser_logins.py)."""
    return user_by_token(session, token) or (user_by_browser_token(session, token) if token.startswith(SESSION_PREFIX) else None)


def _unauthorized(why: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, why, headers={"WWW-Authenticate": "Bearer"})


CurrentUser = Annotated[User, Depends(get_current_user)]


def get_token_holder(user: CurrentUser, credentials: BearerCredentials) -> User:
    """The caller on a route that makes a credential (a new token, a login code): with the user's
    own token only. A browser session acts as its user on the page, but must not turn itself into
    a token that never expires, nor renew itself with login codes for ever."""
    if credentials.credentials.startswith(SESSION_PREFIX):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "a browser session can't make credentials: use your own token (the CLI's)")
    return user


TokenHolder = Annotated[User, Depends(get_token_holder)]


def get_current_host(
    request: Request, settings: SettingsDep, credentials: BearerCredentials
) -> str:
    """The name of the worker host whose token this is (the worker protocol's routes take no user's
    token, and a host's token opens no user route)."""
    host = _token_owner(request, settings, credentials, host_by_token)
    if host is None:
        raise _unauthorized("missing, invalid or revoked host token")
    return host


CurrentHost = Annotated[str, Depends(get_current_host)]


def get_admin(user: CurrentUser) -> User:
    if not user.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "admins only")
    return user


AdminUser = Annotated[User, Depends(get_admin)]


def get_store(settings: SettingsDep) -> ArtifactStore:
    return ArtifactStore(settings.resolved_artifact_root, settings.artifact_reader_gid)


StoreDep = Annotated[ArtifactStore, Depends(get_store)]


def not_found(what: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} not found")


# A row id in the path: the database's BIGINT range, so an absurd id is a 422, not an overflow.
RowId = Annotated[int, Path(ge=1, le=2**63 - 1)]

# A list's pages, newest first: `cursor` is the last id of the previous page.
PageLimit = Annotated[int, Query(ge=1, le=200)]
PageCursor = Annotated[str | None, Query(pattern=r"^\d{1,18}$", description="`next_cursor` of the previous page.")]


def as_utc(moment: datetime | None) -> datetime | None:
    """A time from a query in UTC, the zone the service stores (SQLite compares the stored text, so
    a time with another offset must be converted first); one given without a zone is taken as UTC."""
    if moment is None:
        return None
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def next_page(rows: list, limit: int) -> str | None:
    """The cursor of the page after `rows`; None when this one was the last."""
    return str(rows[-1].id) if len(rows) == limit else None


def visible_job(session: Session, user: User, job_id: int) -> Job:
    """The job, if the caller may see it. Others get the same 404 as for a missing job."""
    job = job_visible_to(session, user, job_id)
    if job is None:
        raise not_found("job")
    return job


def get_visible_job(job_id: RowId, session: SessionDep, user: CurrentUser) -> Job:
    job = visible_job(session, user, job_id)
    # Hand the connection back before the route runs, in another of the thread pool's threads: a
    # connection held across that hop, with every thread waiting for a connection, is a deadlock
    # (until the pool's timeout) under hundreds of requests at once. The job stays loaded.
    session.commit()
    return job


VisibleJob = Annotated[Job, Depends(get_visible_job)]
