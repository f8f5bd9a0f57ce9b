from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, status
from fastapi.responses import StreamingResponse

from api_schemas import CheckpointOut, JobOut, JobPage, JobSpec, JobStatus, LogsOut, MetricSeries, MetricsOut
from service.admission import admit
from service.api.deps import MAY_BE_MISSING, NEEDS_TOKEN, CurrentUser, SessionDep, SettingsDep, VisibleJob
from service.api.events import job_events, job_log_lines, polled_stream
from service.api.views import checkpoint_out, job_out, job_outs, log_line_out
from service.db.checkpoints import list_checkpoints
from service.db.jobs import jobs_visible_to, request_cancel
from service.db.log_lines import log_lines_after, log_tail
from service.db.metrics import metric_series
from service.db.session import session_factory

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING})


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    responses={
        403: {"description": "A `script` job from a user without the can_run_code permission."},
        429: {"description": "The user already has `max_active_jobs_per_user` active jobs; see Retry-After."},
    },
)
def submit_job(
    spec: JobSpec,
    session: SessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobOut:
    return job_out(admit(session, user, spec, settings, idempotency_key))


@router.get("", response_model=JobPage)
def list_jobs(
    session: SessionDep,
    user: CurrentUser,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(pattern=r"^\d{1,18}$", description="`next_cursor` of the previous page.")] = None,
) -> JobPage:
    jobs = jobs_visible_to(session, user, status=status_, limit=limit, before_id=int(cursor) if cursor else None)
    next_cursor = str(jobs[-1].id) if len(jobs) == limit else None
    return JobPage(items=job_outs(session, jobs), next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job: VisibleJob, session: SessionDep) -> JobOut:
    return job_outs(session, [job])[0]


@router.post("/{job_id}/cancel", response_model=JobOut)
def cancel_job(job: VisibleJob, session: SessionDep) -> JobOut:
    return job_out(request_cancel(session, job))


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
    series = metric_series(session, job.id, wanted, from_step, limit)
    return MetricsOut(series={name: MetricSeries(steps=s, values=v) for name, (s, v) in series.items()})


@router.get(
    "/{job_id}/logs",
    response_model=LogsOut,
    responses={200: {"content": {"text/event-stream": {}}, "description": "JSON (LogsOut), or with `follow=true` a stream."}},
)
def get_logs(
    job: VisibleJob,
    session: SessionDep,
    settings: SettingsDep,
    tail: Annotated[int, Query(ge=1, description="The last N lines (without `cursor`), or the page size (with it).")] = 100,
    cursor: Annotated[str | None, Query(pattern=r"^\d{1,18}$", description="`next_cursor` of a previous read: the lines after it.")] = None,
    rank: Annotated[int | None, Query(ge=0, le=1_000_000, description="Only what this process (global rank) printed.")] = None,
    follow: Annotated[
        bool,
        Query(description="Stream as Server-Sent Events (`line` events, id = cursor) the last `tail` lines or those after `cursor`, then each new one, until the job has ended."),
    ] = False,
    last_event_id: Annotated[int | None, Header(ge=0, lt=10**18, description="With `follow`: resume after this line (as `cursor`).")] = None,
):
    limit = min(tail, settings.log_tail_max)
    after = last_event_id if last_event_id is not None else int(cursor) if cursor else None
    if follow:
        if after is None:  # start at the tail: the line just before its first
            first = log_tail(session, job.id, limit, rank)[:1]
            after = first[0].id - 1 if first else 0
        session.close()  # the stream polls with short sessions of its own (see stream_events)
        poll = job_log_lines(session_factory(settings.resolved_database_url), job.id, rank)
        return _event_stream(polled_stream(poll, after, follow=True, poll_seconds=settings.events_poll_seconds, heartbeat_seconds=settings.events_heartbeat_seconds))
    if after is not None:
        lines = log_lines_after(session, job.id, after, limit, rank)
    else:
        lines = log_tail(session, job.id, limit, rank)
    next_cursor = str(lines[-1].id) if lines else str(after or 0)
    out = [log_line_out(line) for line in lines]
    return LogsOut(lines=out, next_cursor=next_cursor)


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointOut])
def get_checkpoints(job: VisibleJob, session: SessionDep) -> list[CheckpointOut]:
    return [checkpoint_out(c) for c in list_checkpoints(session, job.id)]


@router.get("/{job_id}/events", response_class=StreamingResponse, responses={200: {"content": {"text/event-stream": {}}}})
def stream_events(
    job: VisibleJob,
    session: SessionDep,
    settings: SettingsDep,
    follow: Annotated[bool, Query(description="false: send the events there are now, then end.")] = True,
    last_event_id: Annotated[int | None, Header(ge=0, lt=2**31, description="Resume after this event id.")] = None,
) -> StreamingResponse:
    """Status changes, metric points and checkpoints as Server-Sent Events, until the job is final."""
    # The stream polls with short sessions of its own. The request's session would otherwise stay
    # open until the stream ends, holding a connection (and, on SQLite, the write lock).
    session.close()
    poll = job_events(session_factory(settings.resolved_database_url), job.id)
    return _event_stream(
        polled_stream(poll, last_event_id or 0, follow=follow, poll_seconds=settings.events_poll_seconds, heartbeat_seconds=settings.events_heartbeat_seconds)
    )


def _event_stream(messages) -> StreamingResponse:
    # no-cache and X-Accel-Buffering: proxies must pass each message on as it comes.
    return StreamingResponse(messages, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
