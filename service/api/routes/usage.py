from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from api_schemas import JobUsageOut, TeamUsageOut, UsageOut, UserUsageOut
from service.api.deps import NEEDS_TOKEN, CurrentUser, SessionDep, SessionsEndWithRoute, as_utc
from service.db.models import utcnow
from service.db.usage import usage

router = APIRouter(prefix="/v1/usage", tags=["accounts"], responses=NEEDS_TOKEN, route_class=SessionsEndWithRoute)


@router.get("", response_model=UsageOut)
def get_usage(
    session: SessionDep,
    user: CurrentUser,
    since: Annotated[datetime | None, Query(description="Count from this time (ISO 8601); default: since the beginning.")] = None,
    limit: Annotated[int, Query(ge=1, le=200, description="How many of the most-using jobs to list.")] = 20,
) -> UsageOut:
    """Device-seconds (processes × seconds run) per user, per team and per job: the caller's own, or everyone's for an admin."""
    now = utcnow()
    since = as_utc(since)
    found = usage(session, now=now, since=since, owner=None if user.is_admin else user)
    users = [UserUsageOut(user=name, jobs=n, device_seconds=round(s, 3)) for name, (n, s) in found.users.items()]
    jobs = [JobUsageOut(job_id=i, name=name, owner=owner, device_seconds=round(s, 3)) for i, name, owner, s in found.jobs[:limit]]
    teams = [TeamUsageOut(team=name, jobs=n, device_seconds=round(s, 3)) for name, (n, s) in found.teams.items()]
    return UsageOut(
        since=since, until=now, users=sorted(users, key=lambda u: -u.device_seconds), jobs=jobs, teams=sorted(teams, key=lambda t: -t.device_seconds)
    )
