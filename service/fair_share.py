"""Teams' quotas and fair share: what each team may hold now, and which waiting job goes first.

Quotas are Kueue's idea. A team's nominal quota is a number of process slots per kind: `cpu`
slots and `cuda` GPUs of the registered hosts, `<pool>/cpu` and `<pool>/cuda` of a cluster pool
(service/db/teams.py: JOB_KIND; "device kind" below means either). Within it, a team's jobs are
placed as they always were. Beyond it a
team may *borrow* slots nobody else wants now; when a team under its quota has a job waiting, the
borrowed slots are reclaimed: the borrowing attempts (a team's newest first, never taking it below
its quota, but for an attempt that crossed the quota line, which borrowed as a whole) are asked to
stop at a checkpoint, the preemption path, and queued again with no restart counted. A kind no team
has a quota for is not governed: every job on it runs as if teams did not exist. A job of no team
(or of a team with no quota of that kind) on a governed kind only borrows.

Fair share is Slurm's classic factor. Each claimant's usage is its device-seconds decayed with a
half-life (a week ago, half), kept up by the scheduler (service/db/teams.py: `decayed_usage`). For a device kind, a
claimant's factor is F = 2^(-U/S): U its share of all that usage, S its entitled share; F is 1 for
a claimant that used nothing lately, 0.5 at exactly its entitlement, towards 0 above it. A team's S
is its quota over all teams' quotas of the kind (equal shares where no team has a quota), a user's
is an equal part of their team's among its users that ran or wait. A waiting job's order is

    priority + seconds waited / priority_aging_seconds + fair_share_weight × F_team × F_user
             + small_job_weight / slots

so equal claimants converge to equal device-hours, an explicit priority still counts for more than
a few points of fair share, and aging keeps anything from waiting forever. The last term (0 by
default) is Slurm's job size factor: a burst of large jobs then doesn't hold every 1-slot job back.

The loaders at the end read what a pass needs (service/db/teams.py); the rest is arithmetic.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.orm import Session

from service.db.models import Attempt, Job
from service.db.teams import NO_TEAM, active_attempts_on, all_teams, decayed_usage, kind_of, slots_held_by_team, waiting_claimants



@dataclass
class Quotas:
    """Each team's nominal quota and what its jobs hold now, per device kind, as a pass goes on."""

    nominal: dict[int, dict[str, int]]  # team id -> device -> slots
    names: dict[int, str]
    in_use: dict[tuple[int, str], int] = field(default_factory=dict)  # (team id or NO_TEAM, device) -> slots

    def governed(self, device: str) -> bool:
        return any(quota.get(device, 0) > 0 for quota in self.nominal.values())

    def quota(self, team_id: int | None, device: str) -> int:
        return self.nominal.get(team_id or NO_TEAM, {}).get(device, 0)

    def held(self, team_id: int | None, device: str) -> int:
        return self.in_use.get((team_id or NO_TEAM, device), 0)

    def within(self, team_id: int | None, device: str, slots: int) -> bool:
        """Whether `slots` more for the team stay within its quota (always, on a kind no quota governs)."""
        return not self.governed(device) or self.held(team_id, device) + slots <= self.quota(team_id, device)

    def held_by_all(self, kind: str) -> int:
        """Slots of this kind every team's (and no team's) attempts hold."""
        return sum(slots for (_, held_kind), slots in self.in_use.items() if held_kind == kind)

    def borrowed(self, team_id: int | None, device: str) -> int:
        return max(0, self.held(team_id, device) - self.quota(team_id, device)) if self.governed(device) else 0

    def take(self, team_id: int | None, device: str, slots: int) -> None:
        key = (team_id or NO_TEAM, device)
        self.in_use[key] = self.in_use.get(key, 0) + slots

    def name(self, team_id: int | None) -> str:
        return f"team {self.names[team_id]}" if team_id else "jobs of no team"

    def reclaimable(self, running: list[tuple[int, int | None, str, int]]) -> set[int]:
        """Of running attempts (id, team id, device, slots), those holding borrowed slots: each team's
        newest first, as many as it holds beyond its quota, so none is taken below it; then, if
        some of that is held by an attempt too wide to stop without, that attempt too: one that
        crossed its team's quota line (a 2-slot job of a team with 1) borrowed as a whole."""
        over = {(team, device): self.borrowed(team, device) for team, device in {(t or NO_TEAM, d) for _, t, d, _ in running}}
        chosen: set[int] = set()
        newest_first = sorted(running, key=lambda a: -a[0])
        for attempt_id, team_id, device, slots in newest_first:
            key = (team_id or NO_TEAM, device)
            if 0 < slots <= over.get(key, 0):
                over[key] -= slots
                chosen.add(attempt_id)
        for attempt_id, team_id, device, slots in newest_first:
            key = (team_id or NO_TEAM, device)
            if attempt_id not in chosen and over.get(key, 0) > 0:
                over[key] -= slots
                chosen.add(attempt_id)
        return chosen

    def describe(self, team_id: int | None, device: str) -> str:
        """`team vision at its quota: 8 of 8 GPUs in use`, `… 10 of 8 GPUs in use, 2 borrowed`; in a
        pool the kind is named: `… 2 of 2 slurm/cpu slots in use`."""
        pool, _, kind = device.rpartition("/")
        unit = "GPUs" if kind == "cuda" else ("slots" if pool else "CPU slots")
        what = f"{device} {unit}" if pool else unit
        quota, held = self.quota(team_id, device), self.held(team_id, device)
        if quota == 0:
            return f"{self.name(team_id)} ha{'s' if team_id else 've'} no {device} quota ({held} {what} borrowed now)"
        borrowed = f", {held - quota} borrowed" if held > quota else ""
        return f"{self.name(team_id)} at its quota: {held} of {quota} {what} in use{borrowed}"


@dataclass
class FairShare:
    """Fair-share factors from the decayed usage (usage_key -> device-seconds) and the quotas."""

    usage: dict[str, float]
    quotas: Quotas
    waiting: set[tuple[int, int, str]] = field(default_factory=set)  # (user id, team id or NO_TEAM, device) with jobs queued

    def __post_init__(self) -> None:
        self._team_use: dict[tuple[int, str], float] = defaultdict(float)
        self._user_use: dict[tuple[int, int, str], float] = defaultdict(float)
        self._total: dict[str, float] = defaultdict(float)
        self._members: dict[tuple[int, str], set[int]] = defaultdict(set)  # (team, device) -> users that ran or wait
        self._teams: dict[str, set[int]] = defaultdict(set)  # device -> teams that ran or wait
        for key, value in self.usage.items():
            user, team, device = key.split(":")
            self._team_use[int(team), device] += value
            self._user_use[int(user), int(team), device] += value
            self._total[device] += value
            self._members[int(team), device].add(int(user))
            self._teams[device].add(int(team))
        for user, team, device in self.waiting:
            self._members[team, device].add(user)
            self._teams[device].add(team)
        self._cache: dict[tuple[int, int, str], float] = {}

    def team_usage(self, team_id: int | None, device: str) -> float:
        return self._team_use[team_id or NO_TEAM, device]

    def team_entitlement(self, team_id: int, device: str) -> float:
        if self.quotas.governed(device):
            total = sum(quota.get(device, 0) for quota in self.quotas.nominal.values())
            return self.quotas.quota(team_id, device) / total
        return 1 / max(1, len(self._teams[device]))

    def team_factor(self, team_id: int | None, device: str) -> float:
        team = team_id or NO_TEAM
        return _factor(self._team_use[team, device], self._total[device], self.team_entitlement(team, device))

    def factor(self, user_id: int, team_id: int | None, device: str) -> float:
        """F_team × F_user for a job of this user and team on this kind of device."""
        key = (user_id, team_id or NO_TEAM, device)
        if key not in self._cache:
            team = team_id or NO_TEAM
            users = max(1, len(self._members[team, device]))
            user = _factor(self._user_use[key], self._team_use[team, device], 1 / users)
            self._cache[key] = self.team_factor(team_id, device) * user
        return self._cache[key]


def _factor(used: float, total: float, entitled: float) -> float:
    """2^(-U/S), U = used / total: 1 with nothing used, 0.5 at the entitlement."""
    if used <= 0 or total <= 0:
        return 1.0
    if entitled <= 0:
        return 0.0
    return 0.5 ** ((used / total) / entitled)


# --- what a scheduler pass reads ---------------------------------------------------------------------

def load_quotas(session: Session) -> Quotas:
    """Every team's quota and, where some team has a quota, the slots each team's active attempts
    hold now, per device kind (with no quota anywhere nothing is governed: no need to count)."""
    teams = all_teams(session)
    quotas = Quotas(nominal={team.id: dict(team.quota) for team in teams}, names={team.id: team.name for team in teams})
    if any(team.quota for team in teams):
        for (team_id, device), slots in slots_held_by_team(session).items():
            quotas.take(team_id, device, slots)
    return quotas


def load_fair_share(
    session: Session, quotas: Quotas, now: datetime, half_life: float, every: float | None, waiting: list[Job] | None = None
) -> FairShare:
    """The decayed usage, brought up to date at most every `every` seconds (None: read only), and
    who has jobs waiting: of `waiting` (the pass's queued jobs), else read."""
    usage = decayed_usage(session, now, half_life, every)
    if waiting is None:
        claimants = waiting_claimants(session)
    else:
        claimants = {(job.owner_id, job.team_id, kind_of(job)) for job in waiting}
    return FairShare(usage, quotas, {(user, team or NO_TEAM, device) for user, team, device in claimants})


def reclaimable_attempts(session: Session, quotas: Quotas) -> tuple[list[Attempt], set[int]]:
    """The active attempts on governed device kinds (with their jobs), and the ids of those that
    hold borrowed slots (Quotas.reclaimable)."""
    governed = [device for device in ("cpu", "cuda") if quotas.governed(device)]
    if not governed:
        return [], set()
    attempts = active_attempts_on(session, governed)
    return attempts, quotas.reclaimable([(a.id, a.job.team_id, kind_of(a.job), a.slots) for a in attempts])


def pool_reclaims(session: Session, quotas: Quotas, pool: str, kind: str, capacity: int) -> list[Attempt]:
    """In a cluster pool, which place its jobs itself: the borrowing attempts to stop so that what
    Trainyard's jobs hold there (this pass's hand-overs counted) fits its `capacity` again, each
    team's newest first and none below its quota. Jobs within their quota are handed over as they
    come; one that finds the pool full waits in its cluster's queue until these have stopped."""
    over = quotas.held_by_all(kind) - capacity
    if over <= 0 or not any(quotas.borrowed(team, kind) for team, held_kind in quotas.in_use if held_kind == kind):
        return []
    # A try's nodes are stopped together: counted by job (one try of a job is active at a time).
    tries: dict[int, list[Attempt]] = defaultdict(list)
    for attempt in active_attempts_on(session, [kind], pool):
        tries[attempt.job_id].append(attempt)
    stopping = {job_id for job_id, nodes in tries.items() if any(a.preempt_requested for a in nodes)}
    over -= sum(a.slots for job_id in stopping for a in tries.pop(job_id))  # asked already: as good as gone
    borrowing = quotas.reclaimable([(job_id, nodes[0].job.team_id, kind, sum(a.slots for a in nodes)) for job_id, nodes in tries.items()])
    chosen: list[Attempt] = []
    for job_id in sorted(borrowing, reverse=True):
        if over <= 0:
            break
        chosen += tries[job_id]
        over -= sum(a.slots for a in tries[job_id])
    return chosen
