from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, status
from sqlalchemy.orm import Session

from api_schemas import SweepOut, SweepPage, SweepSpec
from service.admission import admit_sweep
from service.api.audit import describe, note
from service.api.deps import (
    MAY_BE_MISSING, NEEDS_TOKEN, CurrentUser, PageCursor, PageLimit, RowId, SessionDep, SessionsEndWithRoute, SettingsDep,
    WriteSessionDep, next_page, not_found,
)
from service.api.views import sweep_outs
from service.db.models import Sweep, User
from service.db.sweeps import cancel_sweep, sweep_visible_to, sweeps_visible_to

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING}, route_class=SessionsEndWithRoute)


def get_visible_sweep(sweep_id: RowId, session: SessionDep, user: CurrentUser) -> Sweep:
    """The path's sweep, if the caller may see it. Others get the same 404 as for a missing sweep."""
    return visible_sweep(session, user, sweep_id)


def visible_sweep(session: Session, user: User, sweep_id: int) -> Sweep:
    sweep = sweep_visible_to(session, user, sweep_id)
    if sweep is None:
        raise not_found("sweep")
    return sweep


VisibleSweep = Annotated[Sweep, Depends(get_visible_sweep)]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=SweepOut)
def submit_sweep(
    request: Request, spec: SweepSpec, session: SessionDep, writes: WriteSessionDep, user: CurrentUser, settings: SettingsDep
) -> SweepOut:
    """Start a search; the scheduler submits its trials as jobs (422 naming the field of a base
    spec or search space no job could take)."""
    note(request, detail=f"submit sweep {spec.name} (trials: {describe(spec.base)})")
    sweep = admit_sweep(session, writes, user, spec, settings)
    note(request, detail=f"submit sweep {spec.name}, sweep {sweep.id} (trials: {describe(spec.base)})")
    return sweep_outs(writes, [sweep])[0]


@router.get("", response_model=SweepPage)
def list_sweeps(
    session: SessionDep,
    user: CurrentUser,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
) -> SweepPage:
    sweeps = sweeps_visible_to(session, user, limit=limit, before_id=int(cursor) if cursor else None)
    return SweepPage(items=sweep_outs(session, sweeps), next_cursor=next_page(sweeps, limit))


@router.get("/{sweep_id}", response_model=SweepOut)
def get_sweep(sweep: VisibleSweep, session: SessionDep) -> SweepOut:
    return sweep_outs(session, [sweep])[0]


@router.post("/{sweep_id}/cancel", response_model=SweepOut)
def cancel(request: Request, sweep_id: RowId, session: WriteSessionDep, user: CurrentUser) -> SweepOut:
    note(request, detail=f"cancel sweep {sweep_id}")
    return sweep_outs(session, [cancel_sweep(session, visible_sweep(session, user, sweep_id))])[0]
