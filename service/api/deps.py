"""Dependencies shared by the routes: settings, a DB session, the authenticated user, the artifact store."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api_schemas import ErrorOut
from service.artifacts import ArtifactStore
from service.db.accounts import user_by_token
from service.db.jobs import job_visible_to
from service.db.models import Job, User
from service.db.session import session_factory
from service.settings import Settings


# Error responses for the OpenAPI schema, so clients (and schemathesis) know every status a route gives.
NEEDS_TOKEN = {401: {"model": ErrorOut, "description": "Missing or invalid bearer token."}}
MAY_BE_MISSING = {404: {"model": ErrorOut, "description": "No such item, or not yours."}}


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    with session_factory(settings.resolved_database_url)() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]

_bearer = HTTPBearer(auto_error=False)


def get_current_user(session: SessionDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> User:
    user = user_by_token(session, credentials.credentials) if credentials else None
    if user is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})
    return user


CurrentUser = Annotated[User, Depends(get_current_user)]


def get_store(settings: SettingsDep) -> ArtifactStore:
    return ArtifactStore(settings.resolved_artifact_root)


StoreDep = Annotated[ArtifactStore, Depends(get_store)]


def not_found(what: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} not found")


# A row id in the path: the database's BIGINT range, so an absurd id is a 422, not an overflow.
RowId = Annotated[int, Path(ge=1, le=2**63 - 1)]


def get_visible_job(job_id: RowId, session: SessionDep, user: CurrentUser) -> Job:
    """The path's job, if the caller may see it. Others get the same 404 as for a missing job."""
    job = job_visible_to(session, user, job_id)
    if job is None:
        raise not_found("job")
    return job


VisibleJob = Annotated[Job, Depends(get_visible_job)]
