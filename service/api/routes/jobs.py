from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, status

from api_schemas import CheckpointOut, JobOut, JobPage, JobSpec, JobStatus, LogLineOut, LogsOut, MetricSeries, MetricsOut
from service.api.deps import CurrentUser, SessionDep, SettingsDep, VisibleJob
from service.api.views import checkpoint_out, job_out
from service.datasets import DatasetError, resolve_dataset
from service.db import crud

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

# Jobs run for minutes to days; a client over its quota has no reason to ask again sooner.
QUOTA_RETRY_AFTER_SECONDS = 60


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    responses={429: {"description": "The user already has `max_active_jobs_per_user` active jobs; see Retry-After."}},
)
def submit_job(
    spec: JobSpec,
    session: SessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobOut:
    try:
        resolve_dataset(settings.resolved_data_root, spec.dataset.path)
    except DatasetError as exc:
        detail = [{"loc": ["body", "dataset", "path"], "msg": str(exc), "type": "value_error"}]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail) from exc
    try:
        job = crud.create_job(session, user, spec, idempotency_key, max_active=settings.max_active_jobs_per_user)
    except crud.QuotaExceeded as exc:
        detail = {"msg": str(exc), "limit": exc.limit, "active": exc.active}
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS, detail, headers={"Retry-After": str(QUOTA_RETRY_AFTER_SECONDS)}
        ) from exc
    return job_out(job)


@router.get("", response_model=JobPage)
def list_jobs(
    session: SessionDep,
    user: CurrentUser,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(pattern=r"^\d{1,18}$", description="`next_cursor` of the previous page.")] = None,
) -> JobPage:
    jobs = crud.list_jobs(session, user, status=status_, limit=limit, before_id=int(cursor) if cursor else None)
    next_cursor = str(jobs[-1].id) if len(jobs) == limit else None
    return JobPage(items=[job_out(job) for job in jobs], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job: VisibleJob) -> JobOut:
    return job_out(job)


@router.post("/{job_id}/cancel", response_model=JobOut)
def cancel_job(job: VisibleJob, session: SessionDep) -> JobOut:
    return job_out(crud.request_cancel(session, job))


@router.get("/{job_id}/metrics", response_model=MetricsOut)
def get_metrics(
    job: VisibleJob,
    session: SessionDep,
    settings: SettingsDep,
    names: Annotated[str | None, Query(max_length=1000, description="Comma-separated metric names; all when omitted.")] = None,
    from_step: Annotated[int | None, Query(ge=0)] = None,
    max_points: Annotated[int | None, Query(ge=3, description="Per series; spikes are kept when downsampling.")] = None,
) -> MetricsOut:
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else None
    limit = min(max_points or settings.metrics_max_points, settings.metrics_max_points)
    series = crud.metric_series(session, job.id, wanted, from_step, limit)
    return MetricsOut(series={name: MetricSeries(steps=s, values=v) for name, (s, v) in series.items()})


@router.get("/{job_id}/logs", response_model=LogsOut)
def get_logs(job: VisibleJob, session: SessionDep, settings: SettingsDep, tail: Annotated[int, Query(ge=1)] = 100) -> LogsOut:
    lines = crud.log_tail(session, job.id, min(tail, settings.log_tail_max))
    return LogsOut(lines=[LogLineOut(attempt=line.attempt_number, seq=line.seq, line=line.line) for line in lines])


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointOut])
def get_checkpoints(job: VisibleJob, session: SessionDep) -> list[CheckpointOut]:
    return [checkpoint_out(c) for c in crud.list_checkpoints(session, job.id)]
