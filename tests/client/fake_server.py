"""A minimal stand-in for the Trainyard API, served by uvicorn on 127.0.0.1 in a thread.

Real HTTP, so the client's streaming, Range resume and error handling run as against the service;
no database, scheduler or workers, so it starts in well under a second.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import FileResponse, StreamingResponse

from api_schemas import JobOut, JobPage, JobSpec, JobStatus, MetricSeries, MetricsOut
from tests.helpers import tiny_spec

TOKEN = "test-token"
FOLLOWED_JOB = 99  # every submit returns it; each GET moves it on to the next of `statuses`
GOOD_CHECKPOINT, CORRUPT_CHECKPOINT = 1, 2  # the second is served with a wrong sha256 header
INTERRUPTED_CHECKPOINT = 3  # a request without Range breaks off after INTERRUPTED_AFTER bytes
INTERRUPTED_AFTER = 100_000
LISTED_JOBS = 5  # ids 1..5


def make_job(
    job_id: int, status: JobStatus = JobStatus.queued, step: int = 0, failure_reason: str | None = None, spec: JobSpec | None = None
) -> JobOut:
    spec = spec or JobSpec.model_validate(tiny_spec())
    return JobOut(
        id=job_id, name=spec.name, owner="alice", status=status, step=step, max_steps=spec.training.max_steps,
        priority=0, effective_batch_size=spec.effective_batch_size, restarts=0, failure_reason=failure_reason,
        created_at=datetime.now(timezone.utc), started_at=None, finished_at=None, spec=spec,
    )


class FakeState:
    def __init__(self, model_file: Path):
        self.model_file = model_file
        self.sha256 = hashlib.sha256(model_file.read_bytes()).hexdigest()
        self.reset()

    def reset(self) -> None:
        self.range_headers: list[str | None] = []  # as received by the download route
        self.statuses = [JobStatus.queued, JobStatus.running, JobStatus.succeeded]  # of job 99, one per GET
        self.failure_reason: str | None = None
        self.followed_spec: JobSpec | None = None  # as last submitted


def build_app(state: FakeState) -> FastAPI:
    def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
        if authorization != f"Bearer {TOKEN}":
            raise HTTPException(401, "missing or invalid bearer token")

    app = FastAPI(dependencies=[Depends(authorized)])

    @app.post("/v1/jobs", status_code=201)
    def submit(spec: JobSpec) -> JobOut:
        state.followed_spec = spec
        return make_job(FOLLOWED_JOB, spec=spec)

    @app.get("/v1/jobs")
    def list_jobs(limit: int = 50, cursor: str | None = None) -> JobPage:
        # Newest first; the cursor is the last id of the previous page, like the service's.
        below = int(cursor) if cursor else LISTED_JOBS + 1
        ids = list(range(below - 1, 0, -1))[:limit]
        return JobPage(items=[make_job(i) for i in ids], next_cursor=str(ids[-1]) if len(ids) == limit else None)

    @app.get("/v1/jobs/{job_id}")
    def get_job(job_id: int) -> JobOut:
        if job_id != FOLLOWED_JOB:
            raise HTTPException(404, "job not found")
        status = state.statuses.pop(0) if len(state.statuses) > 1 else state.statuses[0]
        step = {JobStatus.running: 6, JobStatus.succeeded: 12}.get(status, 0)
        failure_reason = state.failure_reason if status.is_final else None
        return make_job(FOLLOWED_JOB, status=status, step=step, failure_reason=failure_reason, spec=state.followed_spec)

    @app.get("/v1/jobs/{job_id}/metrics")
    def metrics(job_id: int, from_step: int = 0) -> MetricsOut:
        steps = [s for s in (1, 2, 3) if s >= from_step]
        return MetricsOut(series={"train_loss": MetricSeries(steps=steps, values=[4.0 - s for s in steps])})

    @app.get("/v1/checkpoints/{checkpoint_id}/download", response_model=None)
    def download(checkpoint_id: int, request: Request) -> FileResponse | StreamingResponse:
        state.range_headers.append(request.headers.get("range"))
        headers = {"X-Checkpoint-SHA256": "0" * 64 if checkpoint_id == CORRUPT_CHECKPOINT else state.sha256}
        if checkpoint_id == INTERRUPTED_CHECKPOINT and "range" not in request.headers:
            return StreamingResponse(_break_off(state.model_file.read_bytes()[:INTERRUPTED_AFTER]), headers=headers)
        return FileResponse(state.model_file, headers=headers)  # answers Range requests, like the service

    return app


def _break_off(first_bytes: bytes) -> Iterator[bytes]:
    yield first_bytes
    raise ConnectionAbortedError("the fake API drops the connection mid-download")  # uvicorn closes it


def serve(state: FakeState) -> AbstractContextManager[str]:
    """Run the fake API on a free port; yields its URL."""
    return serve_app(build_app(state))


@contextmanager
def serve_app(app) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a free port; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()
