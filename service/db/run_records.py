"""A job's run record (api_schemas/run_record.py): its spec, its code bundle's digest, and what each
attempt's worker reported it ran with."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from api_schemas.run_record import AttemptEnvironment, RunEnvironment, RunRecord
from service.db.models import Attempt, Job, Upload


def run_record(session: Session, job: Job) -> RunRecord:
    code = (job.spec.get("script") or {}).get("code") or {}
    code_sha256 = session.scalar(select(Upload.sha256).where(Upload.id == code["upload_id"])) if code.get("upload_id") else None
    attempts = session.scalars(select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.number, Attempt.node_rank)).all()
    return RunRecord(
        job_id=job.id, name=job.name, spec=job.spec, code_sha256=code_sha256,
        attempts=[
            AttemptEnvironment(
                attempt=a.number, node_rank=a.node_rank, host_name=a.host_name, started_at=a.started_at,
                environment=RunEnvironment.model_validate(a.run_environment) if a.run_environment else None,
            )
            for a in attempts
        ],
    )
