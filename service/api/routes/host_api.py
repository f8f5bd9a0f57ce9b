"""The worker protocol's routes (api_schemas/host_api.py): what worker hosts do through the API,
each with its own host token, instead of holding a database connection. Each route acts as the
token's host, on the attempts placed on it only (any other is a 404, as a missing one).

The two requests every host sends every few seconds when all goes well (a heartbeat, a lease
renewal) note the heartbeat in the statement that checks the token, rather than checking it in a
transaction of its own first (a large fleet's API spends most of its time on them); when that finds
nothing, the usual path runs and tells a wrong token (401) from a host not registered (404). A
running attempt's host renews with its report when one is due (`renew_lease`). The token is still
checked before a request's body is read."""

from __future__ import annotations

import math
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy import select

from api_schemas import AttemptStatus, JobEventType
from api_schemas.host_api import (
    HOST_API_PREFIX, AttemptEnd, CheckpointStored, ClaimedAttempt, ClaimRequest, EnvironmentReport, Finished, HostRegistration, HostTerms, Lease,
    LeaseRequest, OutputStored, Rendezvous, Report, Reported,
)
from api_schemas.jobs import CheckpointConfig, CodeSource
from service.api.deps import (
    MAY_BE_MISSING, NEEDS_TOKEN, BearerCredentials, CurrentHost, RowId, SessionsEndWithRoute, SettingsDep, StoreDep, WriteSessionDep, get_current_host,
    not_found,
)
from common.artifacts import ArtifactStore, directory_mark
from service.db.attempts import (
    HeldAttempt, attempt_on_host, claim_attempt, ended_attempts, finish_attempt, gang_rendezvous, record_environment, renew_lease,
    renew_own_lease,
)
from service.db.checkpoints import record_checkpoint, record_refused
from service.db.hosts import deregister_host, heartbeat_by_token, note_heartbeat, register_host
from service.db.log_lines import record_logs
from service.db.metrics import not_stored_yet, record_metrics
from service.db.models import Job, WorkerHost, utcnow
from service.db.outputs import record_output
from service.db.session import session_factory
from service.db.gang_addresses import host_subnet
from common.settings import Settings
from service.uploads import UploadRefused, code_directory

# Each route takes a host's token (401 without one; 429 after many wrong ones); an attempt's, a 404
# for one not placed on the token's host.
router = APIRouter(prefix=HOST_API_PREFIX, tags=["worker protocol"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING}, route_class=SessionsEndWithRoute)

DEFAULT_PORTS = {"postgresql": 5432, "postgres": 5432, "redis": 6379, "rediss": 6379, "amqp": 5672}


def control_plane_ports(settings: Settings) -> list[int]:
    """The service's ports a job must not reach: its database's and broker's, and the configured others."""
    ports = set(settings.control_plane_ports)
    for url in (settings.resolved_database_url, settings.resolved_broker_url):
        parts = urlsplit(url)
        scheme = parts.scheme.split("+")[0]
        if scheme.startswith("sqla") or scheme == "sqlite":
            continue  # a file, not a port
        try:
            port = parts.port
        except ValueError:
            port = None
        if port or DEFAULT_PORTS.get(scheme):
            ports.add(port or DEFAULT_PORTS[scheme])
    return sorted(ports)


@router.post("/register", response_model=HostTerms)
def register(body: HostRegistration, host: CurrentHost, session: WriteSessionDep, settings: SettingsDep) -> HostTerms:
    """The host joins the pool (again, after a restart) with what it offers; it learns the service's timing."""
    if body.name is not None and body.name != host:
        raise HTTPException(403, f"this is host {host}'s token, not {body.name}'s: start the worker with --host-name {host}, "
                                 f"or give it {body.name}'s own token (an admin makes one: trainyard host token {body.name})")
    running = session.get(WorkerHost, host)
    if running is not None and body.instance is not None and running.info.get("instance") not in (None, body.instance):
        silent = (utcnow() - running.last_heartbeat).total_seconds()
        if silent < settings.host_timeout_seconds:  # two processes under one name would take each other's attempts
            raise HTTPException(409, f"another worker is up as host {host} (its last heartbeat {silent:.0f} s ago): stop it, "
                                     f"or start this one under another --host-name; a dead one's name is free after {settings.host_timeout_seconds:g} s")
    info = body.info | ({"instance": body.instance} if body.instance else {})
    net_index = register_host(session, host, body.device, body.slots, info, body.address)
    subnet = host_subnet(settings.gang_network, net_index) if net_index is not None and settings.gang_network else None
    return HostTerms(
        attempt_subnet=subnet,
        heartbeat_seconds=settings.heartbeat_seconds, lease_seconds=settings.lease_seconds,
        idle_heartbeat_seconds=max(settings.heartbeat_seconds, settings.host_timeout_seconds / 3),
        dispatch_timeout_seconds=settings.dispatch_timeout_seconds, max_log_lines_per_attempt=settings.max_log_lines_per_attempt,
        max_runtime_hours=settings.max_runtime_hours, max_attempt_disk_gb=settings.max_attempt_disk_gb, control_plane_ports=control_plane_ports(settings),
        artifact_mark=directory_mark(settings.resolved_artifact_root, make=True), data_mark=directory_mark(settings.resolved_data_root, make=True),
        artifact_reader_gid=settings.artifact_reader_gid,
    )


def _heard(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> str | None:
    """The host whose live token this is, its heartbeat noted in the statement that checks the token;
    None for a wrong token, or a host not registered (taken out of the pool)."""
    if credentials is None:
        return None
    with session_factory(settings.resolved_database_url)() as session:
        host = heartbeat_by_token(session, credentials.credentials)
        session.commit()
    return host


def get_seen_host(request: Request, settings: SettingsDep, credentials: BearerCredentials) -> str:
    """The token's host, its heartbeat noted (a lease renewal is its host's heartbeat: a host renewing
    leases sends none of its own); a host not registered is still itself, its attempts its own."""
    return _heard(settings, credentials) or get_current_host(request, settings, credentials)


SeenHost = Annotated[str, Depends(get_seen_host)]


@router.post("/heartbeat", status_code=204, responses={404: {"description": "Not registered (deregistered, or never): register again."}})
def heartbeat(request: Request, settings: SettingsDep, credentials: BearerCredentials) -> Response:
    if _heard(settings, credentials):
        return Response(status_code=204)
    get_current_host(request, settings, credentials)  # 401 (429) for a wrong token
    raise not_found("host registration")


@router.post("/deregister", status_code=204)
def deregister(host: CurrentHost, session: WriteSessionDep) -> Response:
    """Shutting down: no more attempts are placed here."""
    deregister_host(session, host)
    return Response(status_code=204)


def _own(session, host: str, attempt_id: int, lease_owner: str) -> HeldAttempt:
    held = attempt_on_host(session, attempt_id, host, lease_owner)
    if held is None:
        raise not_found("attempt")
    return held


@router.post("/attempts/{attempt_id}/claim", response_model=ClaimedAttempt, responses={409: {"description": "Not this host's to run now."}})
def claim(
    attempt_id: RowId, body: ClaimRequest, host: CurrentHost, session: WriteSessionDep, settings: SettingsDep, store: StoreDep
) -> ClaimedAttempt:
    """Take the attempt under a lease: 409 if it is not to be run (already claimed, ended, cancelled)."""
    _own(session, host, attempt_id, body.lease_owner)
    claimed = claim_attempt(session, attempt_id, body.lease_owner, settings.lease_seconds, body.rendezvous, settings.gang_network)
    if claimed is None:
        raise HTTPException(status.HTTP_409_CONFLICT, "attempt is not to be run (already claimed, ended or cancelled)")
    # What earlier attempts of the job (lost with their host, say) left half uploaded won't be sealed now.
    store.drop_uploads(claimed.job_id, lambda attempts: ended_attempts(session, attempts))
    if (script := claimed.spec.get("script")) is not None:
        # Where the script's code is on the storage the hosts share; a path that is refused (gone,
        # or outside the code root) says why in place of one.
        try:
            claimed.code_path = str(code_directory(settings, CodeSource.model_validate(script["code"])))
        except UploadRefused as exc:
            claimed.code_refused = str(exc)
    return claimed


def _renewed(session, host: str, attempt_id: int, lease_owner: str, settings: Settings) -> tuple[HeldAttempt, Lease]:
    """The attempt and its lease, renewed. The usual case (its own attempt, the lease held) is one
    statement; any other is told apart after it (404, or no longer held)."""
    if renewed := renew_own_lease(session, host, attempt_id, lease_owner, settings.lease_seconds):
        return renewed
    held = _own(session, host, attempt_id, lease_owner)
    return held, renew_lease(session, held, settings.lease_seconds)


@router.post("/attempts/{attempt_id}/lease", response_model=Lease)
def lease(attempt_id: RowId, body: LeaseRequest, host: SeenHost, session: WriteSessionDep, settings: SettingsDep) -> Lease:
    """Renew the lease; it says whether the attempt is still this host's, and if it is to stop. A
    running attempt's host sends one each heartbeat when it has nothing to report (else its report renews)."""
    return _renewed(session, host, attempt_id, body.lease_owner, settings)[1]


@router.post("/attempts/{attempt_id}/rendezvous", response_model=Rendezvous)
def rendezvous(attempt_id: RowId, body: LeaseRequest, host: CurrentHost, session: WriteSessionDep, settings: SettingsDep) -> Rendezvous:
    """Node 0's host:port of this gang's try, once node 0 has claimed; the lease is renewed while it waits."""
    held = _own(session, host, attempt_id, body.lease_owner)
    lease = renew_lease(session, held, settings.lease_seconds)
    rendezvous, gang = gang_rendezvous(session, held) if lease.held else (None, None)
    return Rendezvous(rendezvous=rendezvous, gang=gang, lease=lease)


@router.post("/attempts/{attempt_id}/environment", status_code=204)
def environment(attempt_id: RowId, body: EnvironmentReport, host: CurrentHost, session: WriteSessionDep) -> Response:
    """What the attempt runs with (its inputs' digests, packages, device): its part of the job's run record."""
    held = _own(session, host, attempt_id, body.lease_owner)
    record_environment(session, held.attempt_id, body.environment.model_dump(mode="json"))
    return Response(status_code=204)


@router.post("/attempts/{attempt_id}/report", response_model=Reported)
def report(attempt_id: RowId, body: Report, host: CurrentHost, session: WriteSessionDep, settings: SettingsDep, request: Request) -> Reported:
    """Store metrics, log lines and refused transfers; all of it idempotent, so a report is sent again
    whole if its answer was lost. The answer says when to send the next (service/api/report_pacing.py),
    and, when asked, renews the lease before anything is stored: a host reporting each heartbeat sends
    no lease request (at 500 running attempts, those were 100 of the API's 250 requests a second)."""
    if body.renew_lease:
        held, lease = _renewed(session, host, attempt_id, body.lease_owner, settings)
        # The host's heartbeat, as a lease request's is: written with what the report stores, in its
        # transaction (a plain report writes nothing of it).
        note_heartbeat(session, host)
    else:
        held, lease = _own(session, host, attempt_id, body.lease_owner), None
    points = [(step, name, math.nan if value is None else value) for step, name, value in body.metrics]
    if body.resent:
        points = not_stored_yet(session, held.job_id, points)
    record_metrics(session, held.job_id, held.attempt_id, points)
    record_logs(session, held.job_id, held, body.logs)
    for refused in body.refused:
        record_refused(session, held.job_id, JobEventType(refused.kind), refused.step, refused.what, refused.reason)
    session.commit()  # the heartbeat, where nothing was stored
    return Reported(next_report_seconds=request.app.state.report_pacing.next_report_seconds(), lease=lease)


def _stored_path(store: ArtifactStore, held: HeldAttempt, path: str, folder: str) -> None:
    """A path the host says it put in the store: under its own job's `folder`, and there."""
    prefix = f"jobs/{held.job_id}/{folder}/"
    try:
        present = path.startswith(prefix) and ".." not in path.split("/") and store.path(path).exists()
    except ValueError:
        present = False
    if not present:
        raise HTTPException(422, f"path: not an item of this job's {folder} in the artifact store")


@router.post("/attempts/{attempt_id}/checkpoints", status_code=204)
def checkpoint_stored(attempt_id: RowId, body: CheckpointStored, host: CurrentHost, session: WriteSessionDep, store: StoreDep) -> Response:
    """A checkpoint the host took into the store (verified against its manifest): listed from now
    on, and the oldest past the job's `checkpoint.keep_last` deleted (but the best, with `keep_best`: by its `best_metric`)."""
    held = _own(session, host, attempt_id, body.lease_owner)
    _stored_path(store, held, body.path, "checkpoints")
    spec = session.scalar(select(Job.spec).where(Job.id == held.job_id))
    policy = CheckpointConfig.from_stored(spec.get("checkpoint", {}))  # its defaults, where a spec has none
    stale_paths = record_checkpoint(
        session, held.job_id, held.attempt_id, body.step, body.path, body.sha256, body.size, policy.keep_last, best=policy
    )
    for stale in stale_paths:
        store.delete(stale)
    return Response(status_code=204)


@router.post("/attempts/{attempt_id}/outputs", status_code=204)
def output_stored(attempt_id: RowId, body: OutputStored, host: CurrentHost, session: WriteSessionDep, store: StoreDep) -> Response:
    """A script's output folder the host copied into the store, replacing its name's earlier copy."""
    held = _own(session, host, attempt_id, body.lease_owner)
    _stored_path(store, held, body.path, "outputs")
    if replaced := record_output(session, held.job_id, held.attempt_id, body.name, body.step, body.path, body.sha256, body.size, body.files):
        store.delete(replaced)
    return Response(status_code=204)


@router.post("/attempts/{attempt_id}/finish", response_model=Finished)
def finish(attempt_id: RowId, body: AttemptEnd, host: CurrentHost, session: WriteSessionDep, store: StoreDep) -> Finished:
    """How the attempt ended, through the state machine; `ended` False if its lease was lost first.
    A rollback's dropped checkpoints are deleted from the store once that is recorded."""
    held = _own(session, host, attempt_id, body.lease_owner)
    dropped: list[str] = []
    ended = finish_attempt(session, held, AttemptStatus(body.outcome), body.reason, retry=body.retry, rollback=body.rollback, dropped=dropped)
    for path in dropped:
        store.delete(path)
    store.drop_uploads(held.job_id, lambda attempts: [held.attempt_id] if held.attempt_id in attempts else [])
    return Finished(ended=ended)
