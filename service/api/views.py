"""Turn database rows into API models."""

from __future__ import annotations

from sqlalchemy.orm import Session, object_session

from api_schemas import (
    AttemptOut, CheckpointOut, JobEventOut, JobOut, JobSpec, JobStatus, LogLineOut, OutputOut, RollbackOut, SweepOut, SweepSpec, TrialOut,
)
from service.db.jobs import rollback_events
from service.db.metrics import latest_metrics
from service.db.models import Checkpoint, Job, JobEvent, JobOutput, LogLine, Sweep, utcnow
from service.db.scheduler_processes import last_scheduler_pass, no_scheduler_note
from service.db.sweeps import trial_jobs

# The latest values the jobs table shows: last loss, and the step time its rate and ETA come from.
PROGRESS_METRICS = ["train_loss", "step_time_s"]


def job_outs(session: Session, jobs: list[Job], scheduler_interval_seconds: float | None = None) -> list[JobOut]:
    """`scheduler_interval_seconds`: given, a queued job's waiting reason says when no scheduler runs."""
    latest = latest_metrics(session, [job.id for job in jobs], PROGRESS_METRICS)
    outs = [job_out(job, latest.get(job.id, {})) for job in jobs]
    if scheduler_interval_seconds is not None and any(out.status == JobStatus.queued for out in outs):
        last, now = last_scheduler_pass(session), utcnow()
        for out in outs:
            if out.status == JobStatus.queued and (note := no_scheduler_note(last, now, scheduler_interval_seconds, out.created_at)):
                out.waiting_reason = note  # the scheduler's own reason, stored at its last pass, is stale
    return outs


def job_out(job: Job, latest: dict[str, float] | None = None) -> JobOut:
    spec = JobSpec.from_stored(job.spec)
    latest = latest or {}
    # A rate and an ETA only while it runs: a finished, cancelled or failed job has no speed.
    step_time = latest.get("step_time_s") if job.status == JobStatus.running else None
    return JobOut(
        id=job.id,
        name=job.name,
        owner=job.owner.name,
        status=job.status,
        step=job.step,
        max_steps=job.planned_steps,
        priority=job.priority,
        effective_batch_size=spec.effective_batch_size,
        # Failures used count the last one too, after which the job was not started again.
        restarts=min(job.restarts, spec.max_restarts),
        rollbacks=job.rollbacks,
        rollback_marks=[RollbackOut.model_validate(data) for data in rollback_events(object_session(job), job.id)] if job.rollbacks else [],
        failure_reason=job.failure_reason,
        waiting_reason=job.waiting_reason if job.status == JobStatus.queued else None,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        spec=spec,
        attempts=[
            AttemptOut(
                id=a.id,
                number=a.number,
                node_rank=a.node_rank,
                host_name=a.host_name,
                processes=a.slots,
                status=a.status,
                failure_reason=a.failure_reason,
                resumed_from_step=a.resumed_from_step,
                created_at=a.created_at,
                started_at=a.started_at,
                finished_at=a.finished_at,
                pool=a.pool,
                cluster_job_id=a.cluster_job_id,
                cluster_state=a.cluster_state,
            )
            for a in job.attempts
        ],
        last_train_loss=latest.get("train_loss"),
        steps_per_second=1 / step_time if step_time else None,
        eta_seconds=(job.max_steps - job.step) * step_time if step_time and job.max_steps else None,
        sweep_id=job.sweep_id,
        trial_number=job.trial_number,
    )


def checkpoint_out(checkpoint: Checkpoint, eval_loss: float | None = None, best: bool = False, best_value: float | None = None) -> CheckpointOut:
    return CheckpointOut(
        id=checkpoint.id,
        job_id=checkpoint.job_id,
        step=checkpoint.step,
        sha256=checkpoint.sha256,
        size_bytes=checkpoint.size_bytes,
        created_at=checkpoint.created_at,
        eval_loss=eval_loss,
        best=best,
        best_value=best_value,
    )


def output_out(output: JobOutput) -> OutputOut:
    return OutputOut(
        job_id=output.job_id, name=output.name, step=output.step, sha256=output.sha256, size_bytes=output.size_bytes,
        files=output.files, created_at=output.created_at,
    )


def job_event_out(event: JobEvent) -> JobEventOut:
    return JobEventOut(id=event.seq, type=event.type, at=event.created_at, data=event.data)


def log_line_out(line: LogLine) -> LogLineOut:
    return LogLineOut(attempt=line.attempt_number, rank=line.rank, seq=line.seq, line=line.line)


def sweep_outs(session: Session, sweeps: list[Sweep]) -> list[SweepOut]:
    """Each sweep with its trials and best trial: two queries for the whole page."""
    trials = trial_jobs(session, [sweep.id for sweep in sweeps])
    metrics = {sweep.id: sweep.spec["objective"]["metric"] for sweep in sweeps}
    latest = latest_metrics(session, [job.id for jobs in trials.values() for job in jobs], sorted(set(metrics.values())))
    return [sweep_out(sweep, trials[sweep.id], {job.id: latest.get(job.id, {}).get(metrics[sweep.id]) for job in trials[sweep.id]}) for sweep in sweeps]


def sweep_out(sweep: Sweep, jobs: list[Job], values: dict[int, float | None]) -> SweepOut:
    spec = SweepSpec.from_stored(sweep.spec)
    trials = [
        TrialOut(
            number=job.trial_number,
            job_id=job.id,
            params=job.trial["params"],
            status=job.status,
            step=job.step,
            value=values[job.id],
            reason=job.failure_reason if job.status != JobStatus.succeeded else None,
        )
        for job in jobs
    ]
    finished = [trial for trial in trials if trial.status == JobStatus.succeeded and trial.value is not None]
    sign = 1 if spec.objective.direction == "min" else -1
    best = min(finished, key=lambda trial: (sign * trial.value, trial.number), default=None)
    return SweepOut(
        id=sweep.id,
        name=sweep.name,
        owner=sweep.owner.name,
        status=sweep.status,
        failure_reason=sweep.failure_reason,
        created_at=sweep.created_at,
        finished_at=sweep.finished_at,
        spec=spec,
        trials=trials,
        best_trial=best.number if best else None,
        best_spec=next(job.spec for job in jobs if job.id == best.job_id) if best else None,
    )
