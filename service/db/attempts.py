"""An attempt from its worker's side (through the worker protocol, service/api/routes/host_api.py):
claim it, hold its lease, find its gang's node 0, record how it ended."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import bindparam, exists, func, select, update
from sqlalchemy.orm import Session, aliased, joinedload, lazyload

from api_schemas import AttemptStatus, JobStatus
from api_schemas.host_api import ClaimedAttempt, GangNode, Lease, Rollback
from service.db import state
from service.db.checkpoints import drop_checkpoints_at, drop_checkpoints_from
from service.db.models import Attempt, Checkpoint, Job, WorkerHost, utcnow
from service.db.gang_addresses import free_address, host_subnet


# The statements of every heartbeat, built once, on the tables: built for each call through the ORM,
# a statement cost the API ~3x the CPU (callgrind, bench/README.md), and 500 running hosts send
# 100 a second.
_attempts, _jobs = Attempt.__table__, Job.__table__
_ATTEMPT_ON_HOST = select(_attempts.c.id, _attempts.c.job_id, _attempts.c.number, _attempts.c.host_name).where(_attempts.c.id == bindparam("attempt_id"))
_RENEW_OWN_LEASE = (
    update(_attempts)
    .where(
        _attempts.c.id == bindparam("attempt_id"), _attempts.c.host_name == bindparam("host"),
        _attempts.c.lease_owner == bindparam("owner"), _attempts.c.status == AttemptStatus.running,
    )
    .values(lease_expires_at=bindparam("expires_at"))
    .returning(_attempts.c.job_id, _attempts.c.number)
)
# Any node of a gang asked to stop stops the whole gang (its training processes vote together).
_asked = (_attempts.c.job_id == bindparam("job_id"), _attempts.c.number == bindparam("number"), _attempts.c.preempt_requested.is_(True))
_LEASE = select(
    _jobs.c.cancel_requested, exists().where(*_asked), select(_attempts.c.preempt_reason).where(*_asked).limit(1).scalar_subquery(),
).where(_jobs.c.id == bindparam("job_id"))


@dataclass(frozen=True)
class HeldAttempt:
    """An attempt as its worker names it: which one, and the lease it claimed it under."""

    attempt_id: int
    job_id: int
    number: int
    lease_owner: str


def attempt_on_host(session: Session, attempt_id: int, host_name: str, lease_owner: str) -> HeldAttempt | None:
    """The attempt, if it was placed on `host_name`; None for any other (a host acts on its own only)."""
    row = session.execute(_ATTEMPT_ON_HOST, {"attempt_id": attempt_id}).first()
    session.commit()
    if row is None or row.host_name != host_name:
        return None
    return HeldAttempt(row.id, row.job_id, row.number, lease_owner)


def ended_attempts(session: Session, attempt_ids: list[int]) -> list[int]:
    """Those of `attempt_ids` that have ended, whatever how."""
    rows = session.execute(select(Attempt.id, Attempt.status).where(Attempt.id.in_(attempt_ids))).all()
    return [row.id for row in rows if AttemptStatus(row.status).is_final]


def claim_attempt(
    session: Session, attempt_id: int, lease_owner: str, lease_seconds: float, rendezvous: str | None = None,
    gang_network: str | None = None,
) -> ClaimedAttempt | None:
    """Take ownership of a scheduled attempt. None if it is not ours to run: already claimed (a
    duplicate delivery of the task), ended, or its job was cancelled meanwhile. `rendezvous` is the
    host:port this worker's node 0 of a gang would listen on; the other nodes read it from here.
    `gang_network`: the pool a gang's attempt takes an address of its own from, when every host of
    its try makes gang networks (its rendezvous is then at that address)."""
    # The job and the checkpoint to resume from in the same read, the job's other attempts only if
    # a rule needs them: a claim is on the path of every job's start.
    row = session.execute(_ATTEMPT_TO_CLAIM, {"attempt_id": attempt_id}).first()
    attempt, checkpoint = row if row is not None else (None, None)
    if attempt is None or attempt.status != AttemptStatus.scheduled:
        session.rollback()
        return None
    job = attempt.job
    if job.cancel_requested:
        state.end_attempt(session, job, attempt, AttemptStatus.cancelled, reason="cancelled before start")
        session.commit()
        return None
    now = utcnow()
    net_address = _gang_address(session, attempt, gang_network) if job.spec["resources"].get("nodes", 1) > 1 else None
    if net_address is not None and rendezvous is not None:
        rendezvous = f"{net_address}:{rendezvous.rpartition(':')[2]}"
    attempt.net_address = net_address
    claimed = state.move_attempt(
        session,
        attempt,
        AttemptStatus.running,
        now=now,
        lease_owner=lease_owner,
        lease_expires_at=now + timedelta(seconds=lease_seconds),
        resume_checkpoint_id=checkpoint.id if checkpoint else None,
        resumed_from_step=checkpoint.step if checkpoint else None,
        rendezvous=rendezvous,
    )
    # After a rollback, from the checkpoint before the spike: past the batches of the spike's steps.
    skip = job.rollback_skip
    skip_steps = skip["through_step"] - skip["resume_step"] if skip and (checkpoint.step if checkpoint else 0) == skip["resume_step"] else 0
    # The first node of a gang to start moves the job to running, at the step it resumes from; the
    # others find it there.
    job_running = job.status == JobStatus.running or state.move_job(
        session, job, JobStatus.running, now=now, step=checkpoint.step if checkpoint else 0
    ) or _moved_by_another_node(session, job)
    if not claimed or not job_running:
        session.rollback()
        return None
    session.commit()
    return ClaimedAttempt(
        attempt_id=attempt.id,
        number=attempt.number,
        node_rank=attempt.node_rank,
        job_id=job.id,
        spec=job.spec,
        slots=attempt.slots,
        device_ids=attempt.device_ids,
        lease_owner=lease_owner,
        resume_checkpoint_path=checkpoint.path if checkpoint else None,
        resume_step=checkpoint.step if checkpoint else None,
        skip_steps=skip_steps,
        net_address=net_address,
    )


def _moved_by_another_node(session: Session, job: Job) -> bool:
    """The job was read before another node of its gang, claiming at the same moment, moved it to running."""
    session.refresh(job, ["status"])
    return job.status == JobStatus.running


def _gang_address(session: Session, attempt: Attempt, pool: str | None) -> str | None:
    """A free address of its host's /24 for a gang's attempt, if every host of its try makes gang
    networks (a gang is all in them or all on its hosts' networks: they must reach each other)."""
    if pool is None:
        return None
    hosts = set(session.scalars(select(Attempt.host_name).where(Attempt.job_id == attempt.job_id, Attempt.number == attempt.number)))
    indexes = dict(session.execute(select(WorkerHost.name, WorkerHost.net_index).where(WorkerHost.name.in_(hosts))).all())
    if any(indexes.get(host) is None for host in hosts) or (subnet := host_subnet(pool, indexes[attempt.host_name])) is None:
        return None
    # Its host's row locked: two attempts claimed on it at once don't take the same address.
    session.execute(select(WorkerHost.name).where(WorkerHost.name == attempt.host_name).with_for_update())
    taken = set(session.scalars(select(Attempt.net_address).where(
        Attempt.host_name == attempt.host_name, Attempt.net_address.is_not(None), Attempt.status.in_(state.ACTIVE_ATTEMPT),
    )))
    return free_address(subnet, taken)


_newest = aliased(Checkpoint)
_ATTEMPT_TO_CLAIM = (
    select(Attempt, Checkpoint)
    .options(joinedload(Attempt.job).options(lazyload(Job.attempts), lazyload(Job.owner)))
    .outerjoin(Checkpoint, (Checkpoint.job_id == Attempt.job_id) & (Checkpoint.id == (  # the newest saved (service/db/checkpoints.py)
        select(func.max(_newest.id)).where(_newest.job_id == Attempt.job_id).scalar_subquery()
    )))
    .where(Attempt.id == bindparam("attempt_id"))
)


def renew_lease(session: Session, attempt: HeldAttempt, lease_seconds: float) -> Lease:
    """Extend our lease. `held` is False once the attempt is no longer ours (reaped as lost)."""
    result = session.execute(
        update(Attempt)
        .where(Attempt.id == attempt.attempt_id, Attempt.lease_owner == attempt.lease_owner, Attempt.status == AttemptStatus.running)
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds))
    )
    lease = _lease(session, attempt.job_id, attempt.number, held=result.rowcount == 1)
    session.commit()
    return lease


def renew_own_lease(
    session: Session, host_name: str, attempt_id: int, lease_owner: str, lease_seconds: float,
) -> tuple[HeldAttempt, Lease] | None:
    """`renew_lease` of the host's own running attempt, its lease held, in one statement and the
    lease's read; None for anything else (another host's attempt, a lease no longer held), which
    the caller then tells apart."""
    renewed = session.execute(_RENEW_OWN_LEASE, {
        "attempt_id": attempt_id, "host": host_name, "owner": lease_owner, "expires_at": utcnow() + timedelta(seconds=lease_seconds),
    }).first()
    if renewed is None:
        session.rollback()
        return None
    lease = _lease(session, renewed.job_id, renewed.number, held=True)
    session.commit()
    return HeldAttempt(attempt_id, renewed.job_id, renewed.number, lease_owner), lease


def _lease(session: Session, job_id: int, number: int, held: bool) -> Lease:
    """The lease as its host hears it: whether the job is to be cancelled or the attempt preempted."""
    cancel, preempt, reason = session.execute(_LEASE, {"job_id": job_id, "number": number}).one()
    return Lease(held=held, cancel_requested=bool(cancel), preempt_requested=preempt, preempt_reason=reason)


def record_environment(session: Session, attempt_id: int, environment: dict) -> None:
    """What the attempt runs with, for its job's run record (not a status: no state machine)."""
    session.execute(update(Attempt).where(Attempt.id == attempt_id).values(run_environment=environment))
    session.commit()


def finish_attempt(
    session: Session, claimed: HeldAttempt, outcome: AttemptStatus, reason: str | None = None, *, retry: bool = True,
    rollback: Rollback | None = None, dropped: list[str] | None = None,
) -> bool:
    """Record the end of our attempt; False if we had already lost it. `retry=False`: a failure no
    retry can mend, the job fails at once (see state.end_attempt). `rollback` (with `preempted`): the
    loss guard stopped it; its job's checkpoints from the spike on are dropped (their paths added to
    `dropped`, for the caller to delete from the store), and it goes on from the newest one left,
    past the spike's batches (claim_attempt)."""
    attempt = session.get(Attempt, claimed.attempt_id)
    if attempt is None or attempt.lease_owner != claimed.lease_owner or attempt.status != AttemptStatus.running:
        session.rollback()
        return False
    paths: list[str] = []
    if rollback is not None and outcome == AttemptStatus.preempted and rollback.drop is not None:
        # A script's or custom loop's: the checkpoints it saved after the spike began; skipping data is its own.
        paths, resume_step = drop_checkpoints_at(session, attempt.job_id, rollback.drop)
        attempt.job.rollback_skip = {"resume_step": resume_step, "through_step": resume_step}
    elif rollback is not None and outcome == AttemptStatus.preempted:
        paths, resume_step = drop_checkpoints_from(session, attempt.job_id, rollback.first_step)
        attempt.job.rollback_skip = {"resume_step": resume_step, "through_step": rollback.last_step}
    ended = state.end_attempt(session, attempt.job, attempt, outcome, reason, retry=retry, rollback=rollback)
    if not ended:
        session.rollback()
        return False
    session.commit()
    if dropped is not None:
        dropped += paths
    return True


def gang_rendezvous(session: Session, claimed: HeldAttempt) -> tuple[str | None, list[GangNode] | None]:
    """host:port of node 0 of our try, once it has claimed its attempt (None until then); and where
    its gang networks are, every node's address and its host's, once every node has claimed (None
    until then, and for a gang on its hosts' networks)."""
    rows = session.execute(
        select(Attempt.node_rank, Attempt.rendezvous, Attempt.net_address, WorkerHost.address)
        .join(WorkerHost, WorkerHost.name == Attempt.host_name, isouter=True)
        .where(Attempt.job_id == claimed.job_id, Attempt.number == claimed.number)
    ).all()
    session.commit()
    rendezvous = next((row.rendezvous for row in rows if row.node_rank == 0), None)
    if not rows or any(row.net_address is None for row in rows):
        return rendezvous, None
    return rendezvous, [GangNode(node_rank=row.node_rank, address=row.net_address, host_address=row.address or "") for row in rows]
