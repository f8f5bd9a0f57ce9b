"""Teams in the database: who is in which, their quotas, what they hold now, and their decayed usage."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import Session

from api_schemas import JobStatus
from api_schemas.jobs import ResourcesConfig
from service.db import state
from service.db.models import Attempt, FairShareUsage, Job, Team, TeamMember, User

# The kind of slots a job holds (ResourcesConfig.slot_kind) read from its spec in SQL (both
# dialects' JSON path; NULL || '/' is NULL in both).
JOB_KIND = func.coalesce(Job.spec["resources"]["pool"].as_string().concat("/"), "").concat(Job.spec["resources"]["device"].as_string())
NO_TEAM = 0  # the team id a job of no team is counted under


def resources_of(job: Job) -> ResourcesConfig:
    """The job's resources as admitted, unvalidated again: a scheduler pass reads them for thousands of jobs."""
    return ResourcesConfig.model_construct(**job.spec.get("resources", {}))


def kind_of(job: Job) -> str:
    return resources_of(job).slot_kind


class TeamError(ValueError):
    """A team request that can't be done, in words for the caller."""


def team_named(session: Session, name: str) -> Team | None:
    return session.scalar(select(Team).where(Team.name == name))


def all_teams(session: Session) -> list[Team]:
    return list(session.scalars(select(Team).order_by(Team.name)))


def create_team(session: Session, name: str, quota: dict[str, int]) -> Team:
    # Told apart by case only, two teams would be one to the people naming them.
    if (same := session.scalar(select(Team).where(func.lower(Team.name) == name.lower()))) is not None:
        raise TeamError(f"a team named {same.name!r} exists")
    team = Team(name=name, quota=_positive(quota))
    session.add(team)
    session.flush()
    return team


def set_quota(team: Team, quota: dict[str, int]) -> None:
    team.quota = _positive(quota)


def _positive(quota: dict[str, int]) -> dict[str, int]:
    if bad := [device for device, slots in quota.items() if slots < 0]:
        raise TeamError(f"quota.{bad[0]}: a quota is a number of slots, 0 or more")
    return {device: slots for device, slots in sorted(quota.items()) if slots > 0}


def add_member(session: Session, team: Team, user: User, default: bool) -> None:
    """Add the user (again: only `default` changes); their first team is their default."""
    membership = session.get(TeamMember, (team.id, user.id))
    if membership is None:
        membership = TeamMember(team_id=team.id, user_id=user.id, is_default=False)
        session.add(membership)
        default = default or default_team(session, user) is None
    if default:
        # Through the ORM, not a bulk UPDATE behind its back: an UPDATE clearing every row, then this
        # row set True again, was no change to the session, so an existing default was left cleared.
        session.flush()
        for other in session.scalars(select(TeamMember).where(TeamMember.user_id == user.id)):
            other.is_default = other is membership


def remove_member(session: Session, team: Team, user: User) -> None:
    """Their queued and running jobs keep the team; their default moves to another team of theirs."""
    membership = session.get(TeamMember, (team.id, user.id))
    if membership is None:
        raise TeamError(f"{user.name} is not in team {team.name}")
    was_default = membership.is_default
    session.delete(membership)
    session.flush()
    if was_default and (other := session.scalar(select(TeamMember).where(TeamMember.user_id == user.id).order_by(TeamMember.team_id))):
        other.is_default = True


def members(session: Session, team: Team) -> list[tuple[str, bool]]:
    """(user name, whether it is their default team), by name."""
    query = select(User.name, TeamMember.is_default).join(TeamMember, TeamMember.user_id == User.id).where(TeamMember.team_id == team.id)
    return sorted((name, default) for name, default in session.execute(query))


def teams_of(session: Session, user: User) -> list[str]:
    query = select(Team.name).join(TeamMember, TeamMember.team_id == Team.id).where(TeamMember.user_id == user.id).order_by(Team.name)
    return list(session.scalars(query))


def default_team(session: Session, user: User) -> Team | None:
    query = select(Team).join(TeamMember, TeamMember.team_id == Team.id).where(TeamMember.user_id == user.id, TeamMember.is_default)
    return session.scalar(query)


def team_for_job(session: Session, user: User, name: str | None) -> Team | None:
    """The team a job of `user` runs under: the one it names (theirs, or TeamError), else their default."""
    if name is None:
        return default_team(session, user)
    team = team_named(session, name)
    if team is None or session.get(TeamMember, (team.id, user.id)) is None:
        yours = ", ".join(teams_of(session, user)) or "none (an admin adds you: trainyard team add TEAM USER)"
        problem = f"no team named {name!r}" if team is None else f"you are not in team {name!r}"
        raise TeamError(f"{problem}; your teams: {yours}")
    return team


# --- what the scheduler's fair share reads (service/fair_share.py) ---------------------------------

def usage_key(user_id: int, team_id: int | None, device: str) -> str:
    return f"{user_id}:{team_id or NO_TEAM}:{device}"


def decay_and_add(
    usage: dict[str, float], since: datetime, now: datetime, half_life: float, ran: list[tuple[int, int | None, str, int, datetime, datetime | None]]
) -> dict[str, float]:
    """The decayed usage at `now`, from the one at `since` and what ran between: (user id, team id,
    device, slots, started, finished or None while running) of each attempt that ran after `since`."""
    decay = 0.5 ** (max(0.0, (now - since).total_seconds()) / half_life)
    updated = defaultdict(float, {key: value * decay for key, value in usage.items() if value * decay >= 0.001})
    for user_id, team_id, device, slots, started, finished in ran:
        seconds = ((finished or now) - max(started, since)).total_seconds()
        if seconds > 0:
            updated[usage_key(user_id, team_id, device)] += slots * seconds
    return dict(updated)


def decayed_usage(session: Session, now: datetime, half_life: float, every: float | None) -> dict[str, float]:
    """Each usage_key's device-seconds, decayed with `half_life`: brought up to `now` at most every
    `every` seconds, with the running time of the attempts that ran since (None: as last left)."""
    row = session.get(FairShareUsage, 1)
    if every is not None and row is None:
        session.add(FairShareUsage(id=1, usage={}, updated_at=now))
    elif every is not None and (now - row.updated_at).total_seconds() >= every:
        ran = session.execute(
            select(Job.owner_id, Job.team_id, JOB_KIND, Attempt.slots, Attempt.started_at, Attempt.finished_at)
            .join(Job, Job.id == Attempt.job_id)
            .where(Attempt.started_at.is_not(None), or_(Attempt.finished_at.is_(None), Attempt.finished_at > row.updated_at))
        ).all()
        row.usage = decay_and_add(row.usage, row.updated_at, now, half_life, ran)
        row.updated_at = now
    return row.usage if row else {}


def slots_held_by_team(session: Session) -> dict[tuple[int | None, str], int]:
    """(team id, device kind) -> slots its active attempts hold now."""
    held = (
        select(Job.team_id, JOB_KIND, func.sum(Attempt.slots))
        .join(Job, Job.id == Attempt.job_id)
        .where(Attempt.status.in_(state.ACTIVE_ATTEMPT))
        .group_by(Job.team_id, JOB_KIND)
    )
    return {(team_id, device): int(slots) for team_id, device, slots in session.execute(held)}


def waiting_claimants(session: Session) -> set[tuple[int, int | None, str]]:
    """(user id, team id, device kind) of every queued job."""
    return set(session.execute(select(Job.owner_id, Job.team_id, JOB_KIND).where(Job.status == JobStatus.queued).distinct()))


def active_attempts_on(session: Session, kinds: list[str], pool: str | None = None) -> list[Attempt]:
    """Active attempts of jobs holding these kinds of slots, with their jobs: on registered hosts,
    or in the cluster pool `pool`."""
    on = Attempt.pool.is_(None) if pool is None else Attempt.pool == pool
    query = select(Attempt).join(Attempt.job).where(Attempt.status.in_(state.ACTIVE_ATTEMPT), JOB_KIND.in_(kinds), on)
    return list(session.scalars(query))


def waiting_jobs_by_team(session: Session) -> dict[int | None, int]:
    query = select(Job.team_id, func.count()).where(Job.status == JobStatus.queued).group_by(Job.team_id)
    return {team_id: n for team_id, n in session.execute(query)}


def forget_team(session: Session, team: Team) -> None:
    """Delete a team with no jobs (a team with jobs keeps its name in their history)."""
    if session.scalar(select(func.count()).select_from(Job).where(Job.team_id == team.id)):
        raise TeamError(f"team {team.name} has jobs; set its quota to 0 instead")
    session.execute(delete(TeamMember).where(TeamMember.team_id == team.id))
    session.delete(team)
