"""The one place service configuration lives. Every field reads TRAINYARD_<NAME> from the environment."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", extra="ignore")

    data_dir: Path = Field(Path(".trainyard"), description="Embedded mode: holds trainyard.db, broker.db, artifacts/, data/ and token.")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default sqlite:///<data_dir>/trainyard.db.")
    broker_url: str | None = Field(None, description="Celery broker URL; default sqla+sqlite:///<data_dir>/broker.db.")
    artifact_root: Path | None = Field(None, description="Checkpoint store, shared by API and workers; default <data_dir>/artifacts.")
    data_root: Path | None = Field(None, description="Datasets that job specs may name; default <data_dir>/data.")
    work_root: Path | None = Field(None, description="Worker scratch space for running attempts; default <data_dir>/work.")
    plugin_dir: Path | None = Field(
        None,
        description="Where `custom` jobs' entrypoint modules are installed (by the operator: they run as code on the workers); "
        "default <data_dir>/plugins, outside the data root that users' datasets live in.",
    )
    code_root: Path | None = Field(
        None, description="Directories of training scripts that `script` jobs may name by path (`script.code.path`); default <data_dir>/code."
    )

    lease_seconds: float = Field(30.0, gt=0, description="A running attempt whose lease is not renewed for this long is lost.")
    heartbeat_seconds: float = Field(5.0, gt=0, description="How often workers heartbeat and renew attempt leases.")
    host_timeout_seconds: float = Field(30.0, gt=0, description="A host silent for this long gets no new attempts.")
    dispatch_timeout_seconds: float = Field(60.0, gt=0, description="A scheduled attempt not claimed for this long is dispatched again.")
    scheduler_interval_seconds: float = Field(
        2.0, gt=0,
        description="Longest pause between scheduler passes, which find expired leases and re-send unclaimed dispatches; "
        "a ring (a job queued, devices freed, a host registered) starts one at once. Each pass costs the host a few ms "
        "of CPU, taken from CPU training beside it.",
    )
    priority_aging_seconds: float = Field(600.0, gt=0, description="A queued job gains one priority point per this many seconds waited.")

    log_format: Literal["text", "json"] = Field("text", description="`json`: one object per line with job_id and attempt_id fields.")

    max_active_jobs_per_user: int | None = Field(
        100, ge=1,
        description="Most queued, scheduled and running jobs one user may have; a submit beyond it gets 429 with Retry-After. On by default on a shared service; None (in code): no limit.",
    )
    max_request_bytes: int = Field(1_000_000, gt=0, description="Largest accepted request body (uploads: max_upload_bytes).")
    max_upload_bytes: int = Field(200_000_000, gt=0, description="Largest dataset file or code bundle one POST /v1/datasets or /v1/code accepts.")
    max_unpacked_bytes: int = Field(500_000_000, gt=0, description="Most bytes a code bundle may unpack to, all files together.")
    script_packages: list[str] = Field(
        ["accelerate", "datasets", "numpy", "safetensors", "tokenizers", "torch", "transformers"],
        description="Packages the workers provide to `script` jobs: what `script.requirements` may name (nothing is installed per job).",
    )
    max_unpacked_files: int = Field(10_000, gt=0, description="Most files (and directories) a code bundle may hold.")
    log_tail_max: int = Field(1000, gt=0, description="Most log lines one /logs request returns.")
    metrics_max_points: int = Field(10_000, gt=0, description="Most points per series one /metrics request returns.")
    events_poll_seconds: float = Field(0.5, gt=0, description="How often an open /events stream looks for new events.")
    download_redirect_prefix: str | None = Field(
        None,
        pattern=r"^/[A-Za-z0-9_/-]*/$",
        description=(
            "Behind nginx: the `internal` location that serves the artifact root (deploy/nginx/trainyard.conf: "
            "`/_artifacts/`). A checkpoint download is then answered with X-Accel-Redirect once access is checked, "
            "and nginx sends the file itself (sendfile, Range). Unset: the API sends the bytes."
        ),
    )
    events_heartbeat_seconds: float = Field(15.0, gt=0, description="An /events stream with nothing to send sends a comment this often, so proxies keep it open.")
    max_failed_auths_per_minute: int = Field(
        30, gt=0, description="Wrong bearer tokens one client address may send per minute; past that its requests get 429 with Retry-After until the minute is over."
    )
    max_streams_per_user: int = Field(
        50, gt=0, description="Most followed /events and /logs streams one user may have open at once on one API process; another gets 429."
    )

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir.resolve()}/trainyard.db"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{self.data_dir.resolve()}/broker.db"

    @property
    def resolved_artifact_root(self) -> Path:
        return (self.artifact_root or self.data_dir / "artifacts").resolve()

    @property
    def resolved_data_root(self) -> Path:
        return (self.data_root or self.data_dir / "data").resolve()

    @property
    def resolved_plugin_dir(self) -> Path:
        return (self.plugin_dir or self.data_dir / "plugins").resolve()

    @property
    def resolved_work_root(self) -> Path:
        return (self.work_root or self.data_dir / "work").resolve()

    @property
    def resolved_code_root(self) -> Path:
        return (self.code_root or self.data_dir / "code").resolve()


@lru_cache
def get_settings() -> Settings:
    return Settings()
