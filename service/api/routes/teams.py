"""Teams: admins make them, set their quotas and members; everyone sees each team's quota, what it
holds and borrows now, and its fair share (service/fair_share.py)."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session

from api_schemas import MemberIn, QuotaIn, TeamIn, TeamOut
from service.admission import Refused, bad_field
from service.api.audit import note
from service.api.deps import NEEDS_TOKEN, AdminUser, CurrentUser, SessionDep, SessionsEndWithRoute, SettingsDep, WriteSessionDep
from service.db.accounts import user_by_name
from service.db.pools import all_pools, pool_named
from service.db.models import Team, utcnow
from service.db.teams import (
    NO_TEAM, TeamError, add_member, all_teams, create_team, forget_team, members, remove_member, set_quota, team_named, waiting_jobs_by_team,
)
from service.fair_share import load_fair_share, load_quotas

router = APIRouter(prefix="/v1/teams", tags=["teams"], responses=NEEDS_TOKEN, route_class=SessionsEndWithRoute)
ADMINS_ONLY = {403: {"description": "Not an admin."}}


@router.get("", response_model=list[TeamOut])
def list_teams(session: SessionDep, user: CurrentUser, settings: SettingsDep) -> list[TeamOut]:
    """Every team: its quota, members, the slots it holds and borrows now, and its fair share."""
    quotas = load_quotas(session)
    # As the scheduler last brought it up to date: a GET writes nothing.
    shares = load_fair_share(session, quotas, utcnow(), settings.fair_share_half_life_seconds, every=None)
    waiting = waiting_jobs_by_team(session)

    def view(name: str, quota: dict, members: list[str], team_id: int | None, devices: list[str]) -> TeamOut:
        return TeamOut(
            name=name, quota=quota, members=members,
            in_use={device: quotas.held(team_id, device) for device in devices},
            borrowed={device: quotas.borrowed(team_id, device) for device in devices if quotas.borrowed(team_id, device)},
            waiting_jobs=waiting.get(team_id, 0),
            recent_device_hours=round(sum(shares.team_usage(team_id, device) for device in devices) / 3600, 3),
            fair_share=round(min((shares.team_factor(team_id, device) for device in devices), default=1.0), 3),
        )

    out = [
        view(team.name, team.quota, [name + ("*" if default else "") for name, default in members(session, team)], team.id,
             sorted({*team.quota, *(device for t, device in quotas.in_use if t == team.id)}))
        for team in all_teams(session)
    ]
    held = sorted(device for (t, device), n in quotas.in_use.items() if t == NO_TEAM and n)
    if out and (held or waiting.get(None)):
        out.append(view("(no team)", {}, [], None, held))  # jobs of users in no team: shown so the numbers add up
    return out


def _pools_exist(session: Session, quota: dict[str, int]) -> None:
    """A quota of a pool's slots (`slurm/cuda`) names a pool the scheduler has described: one that
    doesn't exist (a typo) would be a quota nobody could ever use."""
    for kind in quota:
        pool, _, _ = kind.rpartition("/")
        if pool and pool_named(session, pool) is None:
            names = ", ".join(p.name for p in all_pools(session)) or "none"
            raise bad_field(("quota", kind), f"no pool named {pool!r} (pools: {names}; GET /v1/pools)")


@router.post("", response_model=TeamOut, status_code=HTTPStatus.CREATED, responses=ADMINS_ONLY)
def create(request: Request, session: WriteSessionDep, admin: AdminUser, settings: SettingsDep, body: TeamIn) -> TeamOut:
    _pools_exist(session, body.quota)
    try:
        create_team(session, body.name, body.quota)
    except TeamError as exc:
        raise Refused(HTTPStatus.CONFLICT, ("name",), str(exc)) from exc
    session.commit()
    note(request, detail=f"created team {body.name} with quota {body.quota}")
    return _one(session, settings, body.name)


@router.put("/{name}/quota", response_model=TeamOut, responses=ADMINS_ONLY)
def put_quota(request: Request, session: WriteSessionDep, admin: AdminUser, settings: SettingsDep, name: str, body: QuotaIn) -> TeamOut:
    team = _team(session, name)
    _pools_exist(session, body.quota)
    before = dict(team.quota)
    set_quota(team, body.quota)
    session.commit()
    note(request, detail=f"team {name} quota {before} -> {team.quota}")
    return _one(session, settings, name)


@router.post("/{name}/members", response_model=TeamOut, responses=ADMINS_ONLY)
def put_member(request: Request, session: WriteSessionDep, admin: AdminUser, settings: SettingsDep, name: str, body: MemberIn) -> TeamOut:
    team = _team(session, name)
    user = user_by_name(session, body.user)
    if user is None:
        raise bad_field(("user",), f"no user named {body.user!r}")
    add_member(session, team, user, body.default)
    session.commit()
    note(request, detail=f"added {body.user} to team {name}" + (" (default)" if body.default else ""))
    return _one(session, settings, name)


@router.delete("/{name}/members/{user_name}", response_model=TeamOut, responses=ADMINS_ONLY)
def delete_member(request: Request, session: WriteSessionDep, admin: AdminUser, settings: SettingsDep, name: str, user_name: str) -> TeamOut:
    team = _team(session, name)
    user = user_by_name(session, user_name)
    try:
        if user is None:
            raise TeamError(f"no user named {user_name!r}")
        remove_member(session, team, user)
    except TeamError as exc:
        raise Refused(HTTPStatus.NOT_FOUND, None, str(exc)) from exc
    session.commit()
    note(request, detail=f"removed {user_name} from team {name}")
    return _one(session, settings, name)


@router.delete("/{name}", status_code=HTTPStatus.NO_CONTENT, responses=ADMINS_ONLY)
def delete_team(request: Request, session: WriteSessionDep, admin: AdminUser, name: str) -> None:
    try:
        forget_team(session, _team(session, name))
    except TeamError as exc:
        raise Refused(HTTPStatus.CONFLICT, None, str(exc)) from exc
    session.commit()
    note(request, detail=f"deleted team {name}")


def _team(session, name: str) -> Team:
    if (team := team_named(session, name)) is None:
        raise Refused(HTTPStatus.NOT_FOUND, None, f"no team named {name!r}")
    return team


def _one(session, settings, name: str) -> TeamOut:
    return next(team for team in list_teams(session, None, settings) if team.name == name)
