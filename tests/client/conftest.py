from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from api_schemas import AttemptStatus, JobStatus
from service.api.main import create_app
from service.db.accounts import create_user
from service.db.attempts import finish_attempt
from service.db.metrics import record_metrics
from service.db.models import Job
from service.db.session import session_factory
from common.settings import Settings
from tests.client.serve import serve_app
from tests.helpers import start_job
from trainyard.progress import ProgressBar

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return os.urandom(300_000)


@pytest.fixture
def database_url(sqlite_url) -> str:
    """The client tests run the service on SQLite only."""
    return sqlite_url


@pytest.fixture
def settings_overrides() -> dict:
    return {"events_poll_seconds": 0.05}


@pytest.fixture
def settings(settings) -> Settings:
    """With the GAN example in the plugin directory, so the example specs are accepted."""
    settings.resolved_plugin_dir.mkdir()
    shutil.copy(REPO / "examples" / "plugins" / "gan_example.py", settings.resolved_plugin_dir)
    return settings


@pytest.fixture
def token(settings) -> str:
    """alice's token."""
    with session_factory(settings.resolved_database_url)() as session:
        return create_user(session, "alice")[1]


@pytest.fixture
def api_url(settings, token) -> Iterator[str]:
    """The real API app served by uvicorn on a free port."""
    with serve_app(create_app(settings)) as url:
        yield url


def run_next_job(
    settings: Settings, seen_running: threading.Event, outcome: AttemptStatus = AttemptStatus.succeeded, reason: str | None = None
) -> int:
    """Act as the scheduler and a worker for the next job submitted: wait for it to be queued, place
    and claim it, report train_loss 1.0 at step 12, keep it running until the client under test has
    seen it so (`seen_running`), then end its attempt with `outcome`. Returns the job's id."""
    sessions = session_factory(settings.resolved_database_url)
    deadline = time.monotonic() + 30
    while (job_id := _queued_job(sessions)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("no job was submitted")
        time.sleep(0.02)
    claimed = start_job(settings, job_id)
    with sessions() as session:
        record_metrics(session, job_id, claimed.attempt_id, [(12, "train_loss", 1.0)])
    if not seen_running.wait(30):
        raise TimeoutError("the client never saw the job running")
    with sessions() as session:
        finish_attempt(session, claimed, outcome, reason)
    return job_id


def _queued_job(sessions) -> int | None:
    with sessions() as session:
        return session.scalar(select(Job.id).where(Job.status == JobStatus.queued).order_by(Job.id.desc()).limit(1))


@pytest.fixture(autouse=True)
def no_ambient_config(monkeypatch, tmp_path: Path) -> None:
    """Tests see neither the developer's TRAINYARD_* variables, config file nor a .trainyard/token in the checkout."""
    for name in ("TRAINYARD_SERVER", "TRAINYARD_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINYARD_CONFIG", str(tmp_path / "no-such-config.yaml"))
    monkeypatch.setenv("TRAINYARD_DATA_DIR", str(tmp_path / "no-such-dir"))


@pytest.fixture
def progress_seen_running(monkeypatch) -> threading.Event:
    """Set once the CLI's progress display has shown a running job (its update is wrapped, not replaced)."""
    seen = threading.Event()
    update = ProgressBar.update

    def observed(self, status, *args, **kwargs):
        if status == JobStatus.running.value:
            seen.set()
        return update(self, status, *args, **kwargs)

    monkeypatch.setattr(ProgressBar, "update", observed)
    return seen
