from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from api_schemas import AuditEntryOut, AuditPage
from service.api.deps import NEEDS_TOKEN, AdminUser, PageCursor, PageLimit, SessionDep, SessionsEndWithRoute, as_utc, next_page
from service.db.audit import entries

router = APIRouter(
    prefix="/v1/audit", tags=["accounts"], responses={**NEEDS_TOKEN, 403: {"description": "Not an admin."}}, route_class=SessionsEndWithRoute
)


@router.get("", response_model=AuditPage)
def audit_trail(
    session: SessionDep,
    admin: AdminUser,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
    user: Annotated[str | None, Query(max_length=100, description="Only this user's requests.")] = None,
    since: Annotated[datetime | None, Query(description="Only requests at or after this time (ISO 8601).")] = None,
) -> AuditPage:
    """Every mutating request and code job, newest first: who, what, when, from where, and the answer. Admins only."""
    rows = entries(session, limit=limit, before_id=int(cursor) if cursor else None, user_name=user, since=as_utc(since))
    items = [
        AuditEntryOut(
            id=r.id, at=r.at, user=r.user_name, client_address=r.client_address, method=r.method, path=r.path,
            status_code=r.status_code, job_id=r.job_id, detail=r.detail,
        )
        for r in rows
    ]
    return AuditPage(items=items, next_cursor=next_page(rows, limit))
