from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from api_schemas import DashboardOut, HostAttemptOut, PoolOut, RunningJobOut, WorkerOut
from service.api.deps import NEEDS_TOKEN, CurrentUser, SessionDep, SessionsEndWithRoute, SettingsDep
from service.db.hosts import all_hosts, online_hosts
from service.db.metrics import latest_metrics
from service.db.models import utcnow
from service.db.pools import all_pools
from service.db.scheduler_processes import last_scheduler_pass, no_scheduler_note
from service.db.monitoring import active_attempts, job_counts, running_jobs

router = APIRouter(prefix="/v1", tags=["dashboard"], responses=NEEDS_TOKEN, route_class=SessionsEndWithRoute)
page_router = APIRouter(route_class=SessionsEndWithRoute)
STATIC_DIR = Path(__file__).resolve().parents[2] / "static"  # the page's script and its vendored chart library, at /static
DASHBOARD_PAGE = STATIC_DIR / "dashboard.html"


@router.get("/workers", response_model=list[WorkerOut])
def list_workers(session: SessionDep, user: CurrentUser, settings: SettingsDep) -> list[WorkerOut]:
    online = {host.name for host in online_hosts(session, utcnow(), settings.host_timeout_seconds)}
    by_host: dict[str, list[HostAttemptOut]] = {}
    for attempt in active_attempts(session):
        mine = user.is_admin or attempt.job.owner_id == user.id
        by_host.setdefault(attempt.host_name, []).append(
            HostAttemptOut(
                job_id=attempt.job_id if mine else None, node_rank=attempt.node_rank, slots=attempt.slots,
                gpus=attempt.device_ids, status=attempt.status,
            )
        )
    return [
        WorkerOut(
            name=host.name,
            address=host.address,
            device=host.device,
            slots=host.slots,
            busy_slots=sum(a.slots for a in by_host.get(host.name, [])),
            gpus=(host.info or {}).get("gpus", []),
            sandbox=(host.info or {}).get("sandbox", "unknown (registered by an older worker)"),
            attempts=by_host.get(host.name, []),
            online=host.name in online,
            last_heartbeat=host.last_heartbeat,
        )
        for host in all_hosts(session)
    ]


@router.get("/pools", response_model=list[PoolOut])
def list_pools(session: SessionDep, user: CurrentUser) -> list[PoolOut]:
    """The cluster pools (a Slurm partition) jobs may run in by naming them as `resources.pool`."""
    return [PoolOut(name=pool.name, backend=pool.backend, seen_at=pool.seen_at, **pool.info) for pool in all_pools(session)]


EVER = datetime.min.replace(tzinfo=timezone.utc)  # the dashboard says so at once when no scheduler ever ran


@router.get("/dashboard", response_model=DashboardOut)
def dashboard(session: SessionDep, user: CurrentUser, settings: SettingsDep) -> DashboardOut:
    jobs = running_jobs(session, user)
    latest = latest_metrics(session, [job.id for job in jobs], ["train_loss"])
    running = [
        RunningJobOut(
            id=job.id,
            name=job.name,
            owner=job.owner.name,
            step=job.step,
            max_steps=job.planned_steps,
            progress=job.step / job.planned_steps if job.planned_steps else None,
            last_train_loss=latest.get(job.id, {}).get("train_loss"),
            host_name=job.attempts[-1].host_name if job.attempts else None,
        )
        for job in jobs
    ]
    now = utcnow()
    return DashboardOut(
        jobs_by_status=job_counts(session, user),
        running=running,
        workers=list_workers(session, user, settings),
        scheduler_down=no_scheduler_note(last_scheduler_pass(session), now, settings.scheduler_interval_seconds, waiting_since=EVER),
    )


@page_router.get("/dashboard", include_in_schema=False)
def dashboard_page() -> FileResponse:
    """The web page; it logs in with a token and reads the /v1 API like any other client."""
    return FileResponse(DASHBOARD_PAGE, media_type="text/html")


@page_router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    """The server's address opened in a browser: the page (it was a bare "Not Found")."""
    return RedirectResponse("/dashboard")
