"""Turn database rows into API models."""

from __future__ import annotations

from api_schemas import AttemptOut, CheckpointOut, JobEventOut, JobOut, JobSpec
from service.db.models import Checkpoint, Job, JobEvent


def job_out(job: Job) -> JobOut:
    spec = JobSpec.model_validate(job.spec)
    return JobOut(
        id=job.id,
        name=job.name,
        owner=job.owner.name,
        status=job.status,
        step=job.step,
        max_steps=job.max_steps,
        priority=job.priority,
        effective_batch_size=spec.effective_batch_size,
        restarts=job.restarts,
        failure_reason=job.failure_reason,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        spec=spec,
        attempts=[
            AttemptOut(
                id=a.id,
                number=a.number,
                host_name=a.host_name,
                status=a.status,
                failure_reason=a.failure_reason,
                resumed_from_step=a.resumed_from_step,
                created_at=a.created_at,
                started_at=a.started_at,
                finished_at=a.finished_at,
            )
            for a in job.attempts
        ],
    )


def checkpoint_out(checkpoint: Checkpoint) -> CheckpointOut:
    return CheckpointOut(
        id=checkpoint.id,
        job_id=checkpoint.job_id,
        step=checkpoint.step,
        sha256=checkpoint.sha256,
        size_bytes=checkpoint.size_bytes,
        created_at=checkpoint.created_at,
    )


def job_event_out(event: JobEvent) -> JobEventOut:
    return JobEventOut(id=event.seq, type=event.type, at=event.created_at, data=event.data)
