"""A script job's output directories (`script.outputs`): one row per job and name, the latest
collection replacing the one before."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import JobOutput, utcnow


def record_output(
    session: Session, job_id: int, attempt_id: int, name: str, step: int | None, path: str, sha256: str, size_bytes: int, files: int
) -> str | None:
    """Register a collected output, replacing an earlier collection of `name`; returns that one's path to delete."""
    row = session.scalar(select(JobOutput).where(JobOutput.job_id == job_id, JobOutput.name == name).with_for_update())
    replaced = None if row is None or row.path == path else row.path
    if row is None:
        row = JobOutput(job_id=job_id, name=name)
        session.add(row)
    row.attempt_id, row.step, row.path, row.sha256, row.size_bytes, row.files = attempt_id, step, path, sha256, size_bytes, files
    row.created_at = utcnow()
    session.commit()
    return replaced


def list_outputs(session: Session, job_id: int) -> list[JobOutput]:
    return list(session.scalars(select(JobOutput).where(JobOutput.job_id == job_id).order_by(JobOutput.name)))


def find_output(session: Session, job_id: int, name: str) -> JobOutput | None:
    return session.scalar(select(JobOutput).where(JobOutput.job_id == job_id, JobOutput.name == name))
