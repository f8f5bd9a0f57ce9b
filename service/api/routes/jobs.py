from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, status
from fastapi.responses import StreamingResponse

from api_schemas import CheckpointConfig, CheckpointOut, JobOut, JobPage, JobSpec, JobStatus, LogsOut, MetricSeries, MetricsOut, ResourcesConfig
from api_schemas.run_record import RunRecord
from service.admission import admit
from service.api.audit import describe, note
from service.api.deps import (
    MAY_BE_MISSING, NEEDS_TOKEN, CurrentUser, PageCursor, PageLimit, RowId, SessionDep, SessionsEndWithRoute, SettingsDep,
    VisibleJob, WriteSessionDep, next_page, visible_job,
)
from service.api.events import EVENTS, LOG_LINES, EventStreamResponse, Source
from service.api.limits import TooManyStreams
from service.api.views import checkpoint_out, job_out, job_outs, log_line_out
from service.db.checkpoints import EVAL_LOSS, best_checkpoint_id, list_checkpoints, metric_at_checkpoints
from service.db.jobs import jobs_visible_to, last_event_seq, request_cancel
from service.db.log_lines import log_lines_after, log_tail
from service.db.metrics import metric_series
from service.db.run_records import run_record

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING}, route_class=SessionsEndWithRoute)


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
    request: Request,
    spec: JobSpec,
    session: SessionDep,
    writes: WriteSessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobOut:
    note(request, detail=f"submit {describe(spec)}")  # audited whether or not it is admitted
    job = admit(session, writes, user, spec, settings, idempotency_key)
    note(request, job_id=job.id, detail=f"submit {describe(spec)}")
    # Described from a read: the write transaction is over, and a lazy load in it would take the write lock again.
    return job_out(visible_job(session, user, job.id))


@router.get("", response_model=JobPage)
def list_jobs(
    session: SessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
    q: Annotated[str | None, Query(max_length=100, description="Only jobs whose name or owner contains this text, in any case.")] = None,
) -> JobPage:
    jobs = jobs_visible_to(session, user, status=status_, limit=limit, before_id=int(cursor) if cursor else None, search=q)
    return JobPage(items=job_outs(session, jobs, settings.scheduler_interval_seconds), next_cursor=next_page(jobs, limit))


@router.get("/{job_id}", response_model=JobOut)
def get_job(job: VisibleJob, session: SessionDep, settings: SettingsDep) -> JobOut:
    return job_outs(session, [job], settings.scheduler_interval_seconds)[0]


@router.post("/{job_id}/cancel", response_model=JobOut)
def cancel_job(request: Request, job_id: RowId, session: SessionDep, writes: WriteSessionDep, user: CurrentUser) -> JobOut:
    note(request, job_id=job_id, detail="cancel")
    request_cancel(writes, visible_job(writes, user, job_id))
    # Described as GET describes it (its last loss too), from a read, as a submit's answer is.
    return job_outs(session, [visible_job(session, user, job_id)])[0]


@router.get("/{job_id}/metrics", response_model=MetricsOut)
def get_metrics(
    job: VisibleJob,
    session: SessionDep,
    settings: SettingsDep,
    names: Annotated[str | None, Query(max_length=1000, description="Comma-separated metric names; all when omitted.")] = None,
    from_step: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="Only points at this step or later.")] = None,
    max_points: Annotated[int | None, Query(ge=3, le=10**9, description="Per series; spikes are kept when downsampling.")] = None,
) -> MetricsOut:
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else None
    limit = min(max_points or settings.metrics_max_points, settings.metrics_max_points)
    # Read first: a point recorded meanwhile is then both in the series and after last_event_id (the same value twice), never in neither.
    last_event_id = last_event_seq(session, job.id)
    series = metric_series(session, job.id, wanted, from_step, limit)
    return MetricsOut(series={name: MetricSeries(steps=s, values=v) for name, (s, v) in series.items()}, last_event_id=last_event_id)


@router.get(
    "/{job_id}/logs",
    response_model=LogsOut,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON (LogsOut), or with `follow=true` a stream."},
        429: {"description": "With `follow`: `max_streams_per_user` streams open already."},
    },
)
def get_logs(
    request: Request,
    job: VisibleJob,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
    tail: Annotated[int, Query(ge=1, le=10**9, description="The last N lines (without `cursor`), or the page size (with it).")] = 100,
    cursor: Annotated[str | None, Query(pattern=r"^\d{1,18}$", description="`next_cursor` of a previous read: the lines after it.")] = None,
    rank: Annotated[int | None, Query(ge=0, le=1_000_000, description="Only what this process (global rank) printed.")] = None,
    follow: Annotated[
        bool,
        Query(description="Stream as Server-Sent Events (`line` events, id = cursor) the last `tail` lines or those after `cursor`, then each new one, until the job has ended."),
    ] = False,
    last_event_id: Annotated[int | None, Header(ge=0, lt=10**18, description="With `follow`: resume after this line (as `cursor`).")] = None,
):
    if rank is not None and rank >= (size := ResourcesConfig.from_stored(job.spec.get("resources", {})).slots):
        # Else an empty answer: `trainyard logs N --rank 7` printed nothing, as if rank 7 were quiet.
        message = f"the job runs {size} processes: ranks 0–{size - 1}" if size > 1 else "the job runs 1 process: rank 0"
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": ["query", "rank"], "msg": message, "type": "value_error"}])
    limit = min(tail, settings.log_tail_max)
    after = last_event_id if last_event_id is not None else int(cursor) if cursor else None
    if follow:
        if after is None:  # start at the tail: the line just before its first
            first = log_tail(session, job.id, limit, rank)[:1]
            after = first[0].id - 1 if first else 0
        return _event_stream(request, user, LOG_LINES, job.id, after, rank=rank, follow=True)
    if after is not None:
        lines = log_lines_after(session, job.id, after, limit, rank)
    else:
        lines = log_tail(session, job.id, limit, rank)
    next_cursor = str(lines[-1].id) if lines else str(after or 0)
    out = [log_line_out(line) for line in lines]
    return LogsOut(lines=out, next_cursor=next_cursor)


@router.get("/{job_id}/record", response_model=RunRecord)
def get_record(job: VisibleJob, session: SessionDep) -> RunRecord:
    """What the job was, to run it again (`trainyard rerun`) or tell two runs apart (`trainyard diff`)."""
    return run_record(session, job)


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointOut])
def get_checkpoints(job: VisibleJob, session: SessionDep) -> list[CheckpointOut]:
    # "best" only where the job keeps it: otherwise the lowest of the kept ones may be far from the job's best.
    policy = CheckpointConfig.from_stored(job.spec.get("checkpoint", {}))
    losses, best, ranked = metric_at_checkpoints(session, job.id), None, {}
    if policy.keep_best:  # ranked by eval_loss (the default), what is read already
        ranked = losses if policy.best_metric == EVAL_LOSS else metric_at_checkpoints(session, job.id, policy.best_metric)
        best = best_checkpoint_id(session, job.id, policy)
    return [checkpoint_out(c, losses.get(c.step), c.id == best, ranked.get(c.step)) for c in list_checkpoints(session, job.id)]


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}, 429: {"description": "`max_streams_per_user` streams open already."}},
)
def stream_events(
    request: Request,
    job: VisibleJob,
    user: CurrentUser,
    follow: Annotated[bool, Query(description="false: send the events there are now, then end.")] = True,
    last_event_id: Annotated[int | None, Header(ge=0, lt=2**31, description="Resume after this event id.")] = None,
) -> StreamingResponse:
    """Status changes, metric points and checkpoints as Server-Sent Events, until the job is final."""
    return _event_stream(request, user, EVENTS, job.id, last_event_id or 0, follow=follow)


def _event_stream(request: Request, user, source: Source, job_id: int, after: int, *, rank: int | None = None, follow: bool) -> StreamingResponse:
    """The stream, if the user has a stream slot left (429 if not). It reads with sessions of its
    own: the route's is closed before the response starts."""
    slots, settings = request.app.state.stream_slots, request.app.state.settings
    try:
        slots.take(user.id)
    except TooManyStreams as exc:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(exc), headers={"Retry-After": "5"}) from None
    tokens = request.app.state.stream_tokens
    messages = request.app.state.feeds.stream(
        source, job_id, after, rank=rank, follow=follow, heartbeat_seconds=settings.events_heartbeat_seconds,
        allowed=lambda: tokens.still_works(user), recheck_seconds=tokens.check_seconds,
    )
    return EventStreamResponse(messages, on_close=lambda: slots.give_back(user.id))
