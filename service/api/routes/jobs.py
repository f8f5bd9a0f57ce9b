from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, status
from fastapi.responses import StreamingResponse

from api_schemas import CheckpointOut, JobOut, JobPage, JobSpec, JobStatus, LogLineOut, LogsOut, MetricSeries, MetricsOut
from service.api.deps import MAY_BE_MISSING, NEEDS_TOKEN, CurrentUser, SessionDep, SettingsDep, VisibleJob
from service.api.events import job_event_stream
from service.api.views import checkpoint_out, job_out, job_outs
from service.datasets import DatasetError, check_labelled, resolve_dataset
from service.db import crud
from service.placement import never_fits
from service.db.session import session_factory

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING})

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
        path = resolve_dataset(settings.resolved_data_root, spec.dataset.path)
        if spec.dataset.kind != "text":
            dataset = spec.dataset
            check_labelled(path, dataset.kind, dataset.text_column, dataset.label_column, spec.model.num_labels)
    except DatasetError as exc:
        detail = [{"loc": ["body", "dataset", "path"], "msg": str(exc), "type": "value_error"}]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail) from exc
    if reason := never_fits(spec.resources, crud.all_hosts(session)):
        detail = [{"loc": ["body", "resources"], "msg": reason, "type": "value_error"}]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail)
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
    return JobPage(items=job_outs(session, jobs), next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job: VisibleJob, session: SessionDep) -> JobOut:
    return job_outs(session, [job])[0]


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
def get_logs(
    job: VisibleJob,
    session: SessionDep,
    settings: SettingsDep,
    tail: Annotated[int, Query(ge=1, description="The last N lines (without `cursor`), or the page size (with it).")] = 100,
    cursor: Annotated[str | None, Query(pattern=r"^\d{1,18}$", description="`next_cursor` of a previous read: the lines after it.")] = None,
    rank: Annotated[int | None, Query(ge=0, le=1_000_000, description="Only what this process (global rank) printed.")] = None,
) -> LogsOut:
    limit = min(tail, settings.log_tail_max)
    if cursor:
        lines = crud.log_lines_after(session, job.id, int(cursor), limit, rank)
    else:
        lines = crud.log_tail(session, job.id, limit, rank)
    next_cursor = str(lines[-1].id) if lines else (cursor or "0")
    out = [LogLineOut(attempt=line.attempt_number, rank=line.rank, seq=line.seq, line=line.line) for line in lines]
    return LogsOut(lines=out, next_cursor=next_cursor)


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointOut])
def get_checkpoints(job: VisibleJob, session: SessionDep) -> list[CheckpointOut]:
    return [checkpoint_out(c) for c in crud.list_checkpoints(session, job.id)]


@router.get("/{job_id}/events", response_class=StreamingResponse, responses={200: {"content": {"text/event-stream": {}}}})
def stream_events(
    job: VisibleJob,
    session: SessionDep,
    settings: SettingsDep,
    follow: Annotated[bool, Query(description="false: send the events there are now, then end.")] = True,
    last_event_id: Annotated[int | None, Header(ge=0, description="Resume after this event id.")] = None,
) -> StreamingResponse:
    """Status changes, metric points and checkpoints as Server-Sent Events, until the job is final."""
    # The stream polls with short sessions of its own. The request's session would otherwise stay
    # open until the stream ends, holding a connection (and, on SQLite, the write lock).
    session.close()
    stream = job_event_stream(
        session_factory(settings.resolved_database_url),
        job.id,
        after=last_event_id or 0,
        follow=follow,
        poll_seconds=settings.events_poll_seconds,
        heartbeat_seconds=settings.events_heartbeat_seconds,
    )
    # no-cache and X-Accel-Buffering: proxies must pass each message on as it comes.
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
