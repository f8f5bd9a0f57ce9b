"""Usage accounting: device-seconds per user, per team and per job, from the attempts' own times.

An attempt uses `slots` devices (processes on its host) from `started_at` to `finished_at`, or to
now while it runs; a gang's attempts count once per host. A lost attempt counts until it was
declared lost, the time its devices were held for it. Summed here rather than in SQL: interval
arithmetic is spelled differently by SQLite and PostgreSQL, and a period holds few attempts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from service.db.models import Attempt, Job, Team, User


@dataclass
class Usage:
    users: dict[str, tuple[int, float]]  # name: (jobs, device-seconds)
    jobs: list[tuple[int, str, str, float]]  # (job id, job name, owner, device-seconds), most first
    teams: dict[str | None, tuple[int, float]]  # team name (None: no team): (jobs, device-seconds)


def usage(session: Session, *, now: datetime, since: datetime | None = None, owner: User | None = None) -> Usage:
    """Device-seconds used in [since, now], by `owner`'s jobs only when given."""
    query = (
        select(Attempt.slots, Attempt.started_at, Attempt.finished_at, Job.id, Job.name, User.name, Team.name)
        .join(Job, Job.id == Attempt.job_id)
        .join(User, User.id == Job.owner_id)
        .outerjoin(Team, Team.id == Job.team_id)
        .where(Attempt.started_at.is_not(None))
    )
    if since is not None:
        query = query.where(or_(Attempt.finished_at.is_(None), Attempt.finished_at > since))
    if owner is not None:
        query = query.where(Job.owner_id == owner.id)
    per_job: dict[tuple[int, str, str, str | None], float] = defaultdict(float)
    for slots, started, finished, job_id, job_name, owner_name, team_name in session.execute(query):
        begin = max(started, since) if since is not None else started
        per_job[job_id, job_name, owner_name, team_name] += slots * max(0.0, ((finished or now) - begin).total_seconds())
    per_user: dict[str, list] = defaultdict(lambda: [0, 0.0])
    per_team: dict[str | None, list] = defaultdict(lambda: [0, 0.0])
    for (_, _, owner_name, team_name), seconds in per_job.items():
        for total in (per_user[owner_name], per_team[team_name]):
            total[0] += 1
            total[1] += seconds
    jobs = sorted(((job_id, name, owner_name, s) for (job_id, name, owner_name, _), s in per_job.items()), key=lambda j: -j[3])
    return Usage(
        users={name: (n, s) for name, (n, s) in per_user.items()}, jobs=jobs, teams={name: (n, s) for name, (n, s) in per_team.items()}
    )
