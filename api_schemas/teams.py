"""Teams: who shares a quota of devices, and what each team holds now (fair share, service/fair_share.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

# What a quota counts: process slots of a device kind on the registered hosts (`cpu`, `cuda`), or in
# a cluster pool (`slurm/cuda`: that pool's GPUs), which jobs name with `resources.pool`.
SlotKind = Annotated[str, Field(pattern=r"^([a-z][a-z0-9-]{0,39}/)?(cpu|cuda)$")]
Slots = Annotated[int, Field(ge=0, le=1_000_000, strict=True)]  # strict: `true` is no number of slots
TeamName = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class TeamIn(BaseModel):
    name: str = TeamName
    quota: dict[SlotKind, Slots] = Field(
        default_factory=dict,
        description="Nominal quota in process slots per kind: `cpu` slots and `cuda` GPUs of the registered hosts, `<pool>/cpu` "
        "and `<pool>/cuda` of a cluster pool (`slurm/cuda`). What the team may always get back; beyond it a team borrows idle "
        "slots, which are reclaimed at a checkpoint when a team under its own quota waits.",
    )


class QuotaIn(BaseModel):
    quota: dict[SlotKind, Slots] = Field(description="The team's new nominal quota per kind (as TeamIn's); a kind left out has none.")


class MemberIn(BaseModel):
    user: str = Field(min_length=1, max_length=100)
    default: bool = Field(False, strict=True, description="Make this the user's default team: where their jobs that name none run.")


class TeamOut(BaseModel):
    name: str
    quota: dict[str, int] = Field(description="Nominal quota in process slots per kind (`cpu`, `cuda`, `<pool>/cuda`…).")
    members: list[str] = Field(description="Its users; a `*` marks one whose default team it is.")
    in_use: dict[str, int] = Field(description="Slots its running and starting attempts hold now, per kind.")
    borrowed: dict[str, int] = Field(description="Of those, the slots beyond its quota: given back at a checkpoint when reclaimed.")
    waiting_jobs: int = Field(description="Its jobs queued now.")
    recent_device_hours: float = Field(
        description="Its usage decayed with the fair-share half-life, as of the scheduler's last update (every fair_share_update_seconds): what orders its waiting jobs."
    )
    fair_share: float = Field(
        description="Its fair-share factor, 2^(-usage share / entitled share): 1 unused, 0.5 at its entitlement, lower above it."
    )
