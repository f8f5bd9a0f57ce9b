"""Checkpoints: registered once complete, the oldest beyond a job's `keep_last` dropped (and
remembered as deleted, so a download of one says why it is gone).

A job's checkpoints are in the order they were saved (by id), which is their steps' order for the
built-in loop but not always for a script: a resumed attempt saves its steps again, and a script
may number its folders by epoch or by save. The newest saved is the one a job resumes from."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from api_schemas import CheckpointConfig, JobEventType
from service.db import state
from service.db.dialect import dialect_insert
from service.db.jobs import job_visible_to
from service.db.models import Checkpoint, DeletedCheckpoint, Job, Metric, User, utcnow

EVAL_LOSS = "eval_loss"  # shown beside each checkpoint


def record_checkpoint(
    session: Session, job_id: int, attempt_id: int, step: int, path: str, sha256: str, size_bytes: int, keep_last: int,
    best: CheckpointConfig | None = None,
) -> list[str]:
    """Register a complete checkpoint, then drop the oldest saved beyond `keep_last` (given the job's
    checkpoint policy `best` where it keeps its best, all but the best: see best_checkpoint_id);
    returns their paths to delete."""
    insert = dialect_insert(session)
    checkpoint_id = session.scalar(
        insert(Checkpoint)
        .values(job_id=job_id, attempt_id=attempt_id, step=step, path=path, sha256=sha256, size_bytes=size_bytes, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["job_id", "path"])
        .returning(Checkpoint.id)
    )
    if checkpoint_id is not None:  # None: a re-sent checkpoint, already recorded
        data = {"checkpoint_id": checkpoint_id, "step": step, "sha256": sha256, "size_bytes": size_bytes}
        state.append_events(session, job_id, [(JobEventType.checkpoint, data)])
        # Past a rollback's resume point, a checkpoint holds the data position after the skip: later resumes need none.
        job = session.get(Job, job_id)
        if job.rollback_skip is not None and step > job.rollback_skip["resume_step"]:
            job.rollback_skip = None
    newest_first = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id.desc())).all()
    stale = newest_first[keep_last:]
    if best is not None and best.keep_best:
        best_id = best_checkpoint_id(session, job_id, best)
        stale = [c for c in stale if c.id != best_id]
    _forget(session, job_id, stale)
    session.commit()
    return [c.path for c in stale if c.path != path]


def drop_checkpoints_from(session: Session, job_id: int, step: int) -> tuple[list[str], int]:
    """Drop the job's checkpoints of `step` and after (a rollback: they hold a diverged run), remembered
    as deleted; their paths to delete, and the step of the newest left (0: none, the run's start)."""
    dropped = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step >= step)).all()
    _forget(session, job_id, dropped)
    newest = session.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id.desc()).limit(1))
    return [c.path for c in dropped], newest or 0


def drop_checkpoints_at(session: Session, job_id: int, paths: list[str]) -> tuple[list[str], int]:
    """Drop the job's checkpoints at these store paths (a script's rollback), as drop_checkpoints_from does."""
    dropped = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.path.in_(paths))).all() if paths else []
    _forget(session, job_id, dropped)
    newest = session.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id.desc()).limit(1))
    return [c.path for c in dropped], newest or 0


def _forget(session: Session, job_id: int, checkpoints: list[Checkpoint]) -> None:
    """Delete these checkpoints' rows, remembered as deleted (their files are the caller's to delete)."""
    if checkpoints:
        session.add_all(DeletedCheckpoint(id=c.id, job_id=job_id, step=c.step, deleted_at=utcnow()) for c in checkpoints)
        session.execute(delete(Checkpoint).where(Checkpoint.id.in_([c.id for c in checkpoints])))


def record_refused(session: Session, job_id: int, kind: JobEventType, step: int | None, what: str, reason: str) -> None:
    """A checkpoint or output the artifact store refused, as an event of the job its owner sees."""
    state.append_events(session, job_id, [(kind, {"step": step, "what": what, "reason": reason})])
    session.commit()


def list_checkpoints(session: Session, job_id: int) -> list[Checkpoint]:
    return list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id)))


def best_checkpoint_id(session: Session, job_id: int, policy: CheckpointConfig) -> int | None:
    """The job's checkpoint at the step of its best `best_metric` (the newest, where a step was saved
    twice); None where no checkpoint's step has one. Read from the metrics, so a checkpoint whose
    step's metrics are still on their way counts once they arrive: it is the newest until then,
    which keep_last never drops."""
    ranked = (Metric.job_id == Checkpoint.job_id) & (Metric.step == Checkpoint.step) & (Metric.name == policy.best_metric)
    return session.scalar(
        select(Checkpoint.id)
        .join(Metric, ranked)
        .where(Checkpoint.job_id == job_id, Metric.value.is_not(None))
        .order_by(Metric.value if policy.best_mode == "min" else Metric.value.desc(), Checkpoint.id.desc())
        .limit(1)
    )


def metric_at_checkpoints(session: Session, job_id: int, name: str = EVAL_LOSS) -> dict[int, float]:
    """The metric `name` by step, at the steps of the job's checkpoints."""
    rows = session.execute(
        select(Metric.step, Metric.value)
        .where(Metric.job_id == job_id, Metric.name == name, Metric.value.is_not(None))
        .where(Metric.step.in_(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))
    )
    return {step: value for step, value in rows}


def checkpoint_visible_to(session: Session, user: User, checkpoint_id: int) -> Checkpoint | None:
    checkpoint = session.get(Checkpoint, checkpoint_id)
    if checkpoint is None or job_visible_to(session, user, checkpoint.job_id) is None:
        return None
    return checkpoint


def deleted_checkpoint_visible_to(session: Session, user: User, checkpoint_id: int) -> DeletedCheckpoint | None:
    deleted = session.get(DeletedCheckpoint, checkpoint_id)
    if deleted is None or job_visible_to(session, user, deleted.job_id) is None:
        return None
    return deleted
