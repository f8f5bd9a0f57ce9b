"""What a team's service says about its users: tokens, the audit trail, and who used how much."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


# A user's name: a login or an e-mail address, as `trainyard user create` takes it.
USER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}$"


class TokenOut(BaseModel):
    token: str = Field(description="Shown once; only its hash is stored. The token it replaces no longer works.")
    expires_at: datetime | None = Field(description="When this token stops working; null: until rotated or revoked.")


class LoginCodeOut(BaseModel):
    code: str = Field(description="Works once, until expires_at: POST it to /v1/login (the page does, from a `#login=CODE` link).")
    expires_at: datetime
    link: str = Field(description="The page's path that signs a browser in with it: `/dashboard#login=CODE` (a fragment: never sent to a server, so in no log).")


class LoginRequest(BaseModel):
    code: str = Field(min_length=1, max_length=100)


class AuditEntryOut(BaseModel):
    id: int
    at: datetime
    user: str | None = Field(description="Who made the request; null when it carried no valid token.")
    client_address: str = Field(description="Where it came from (the proxy's address behind one that does not forward it).")
    method: str
    path: str
    status_code: int = Field(description="How it was answered.")
    job_id: int | None = Field(description="The job it submitted or acted on, where there is one.")
    detail: str | None = Field(description="What it did, e.g. `submitted a script job (train.py)`.")


class AuditPage(BaseModel):
    items: list[AuditEntryOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next (older) page; null on the last page.")


class JobUsageOut(BaseModel):
    job_id: int
    name: str
    owner: str
    device_seconds: float = Field(description="Sum over the job's attempts of processes × seconds run (a running attempt up to now).")


class UserUsageOut(BaseModel):
    user: str
    jobs: int = Field(description="Jobs with at least one attempt that ran in the period.")
    device_seconds: float


class TeamUsageOut(BaseModel):
    team: str | None = Field(description="null: jobs that ran under no team.")
    jobs: int
    device_seconds: float


class UsageOut(BaseModel):
    since: datetime | None = Field(description="Start of the period counted; null: since the beginning.")
    until: datetime = Field(description="When this was computed.")
    users: list[UserUsageOut] = Field(description="Per user: only the caller, or every user for an admin. Most used first.")
    jobs: list[JobUsageOut] = Field(description="The jobs that used the most in the period, most first (at most `limit`).")
    teams: list[TeamUsageOut] = Field(default_factory=list, description="Per team, over the same jobs as `users`. Most used first.")
