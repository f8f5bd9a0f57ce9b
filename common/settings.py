"""The one place every process's configuration lives (the API's, the scheduler's, the workers'):
every field reads TRAINYARD_<NAME> from the environment.

The settings come in groups, one per role that reads them, so that each process's own are in
one class: where state lives and how to log (every process), the API's limits, the scheduler's
timing and the workers'. `Settings` is all of them in one object, which the `trainyard` commands
read to start any role.
"""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class _FromEnvironment(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", extra="ignore")


class StorageSettings(_FromEnvironment):
    """Every process: where state lives. Each place left unset is one under data_dir, so the
    embedded mode needs that one directory; `resolved_*` is the place as used."""

    data_dir: Path = Field(Path(".trainyard"), description="Embedded mode: holds trainyard.db, broker.db, artifacts/, data/ and token.")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default sqlite:///<data_dir>/trainyard.db.")
    broker_url: str | None = Field(None, description="Celery broker URL; default sqla+sqlite:///<data_dir>/broker.db.")
    artifact_root: Path | None = Field(None, description="Checkpoint store, shared by API and workers; default <data_dir>/artifacts.")
    artifact_reader_gid: int | None = Field(
        None, ge=0,
        description="A group that may read stored checkpoints (their files, and the directories down to them), for a proxy that "
                    "sends them itself (TRAINYARD_DOWNLOAD_REDIRECT_PREFIX): its workers' group (the nginx image's is 101). "
                    "Unset: the service's account alone reads the store.",
    )
    gang_network: str | None = Field(
        "100.64.0.0/10", description="Addresses for multi-node gangs' attempts: each worker host that makes gang networks (root, "
        "sandboxed, with ip and nft) takes a /24 of it, each gang attempt a network namespace and an address there that reaches only "
        "its own gang (workers/gang_network.py). Must not overlap a network the hosts use. Empty: gangs keep their hosts' network.",
    )
    shared_artifact_store: bool = Field(
        True, description="Workers: this host mounts the artifact root and the data root at the same paths as the API, and moves "
        "checkpoints and outputs in; false: it sends them through the API, and fetches from it a resume's checkpoint, a script's "
        "code and the data a job's spec names."
    )

    @field_validator("gang_network")
    @classmethod
    def _a_pool_of_subnets(cls, value: str | None) -> str | None:
        if not value:
            return None
        network = ipaddress.ip_network(value)  # a ValueError names the setting
        if network.version != 4 or network.prefixlen > 24:
            raise ValueError("an IPv4 network of /24 or larger, e.g. 100.64.0.0/10")
        return str(network)
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
    environment_root: Path | None = Field(
        None, description="Workers: the cached Python environments of jobs' `environment.pip` (workers/environments.py); default <data_dir>/environments."
    )

    def _under_data_dir(self, given: Path | None, default: str) -> Path:
        return (given or self.data_dir / default).resolve()

    resolved_database_url = property(lambda self: self.database_url or f"sqlite:///{self.data_dir.resolve()}/trainyard.db")
    resolved_broker_url = property(lambda self: self.broker_url or f"sqla+sqlite:///{self.data_dir.resolve()}/broker.db")
    resolved_artifact_root = property(lambda self: self._under_data_dir(self.artifact_root, "artifacts"))
    resolved_data_root = property(lambda self: self._under_data_dir(self.data_root, "data"))
    resolved_work_root = property(lambda self: self._under_data_dir(self.work_root, "work"))
    resolved_plugin_dir = property(lambda self: self._under_data_dir(self.plugin_dir, "plugins"))
    resolved_code_root = property(lambda self: self._under_data_dir(self.code_root, "code"))
    resolved_environment_root = property(lambda self: self._under_data_dir(self.environment_root, "environments"))


class LoggingSettings(_FromEnvironment):
    """Every process: how it logs."""

    log_format: Literal["text", "json"] = Field("text", description="`json`: one object per line with job_id and attempt_id fields.")


class ApiSettings(_FromEnvironment):
    """The API: what one request, one upload and one user may ask of it, and how its streams run."""

    login_code_seconds: int = Field(300, gt=0, description="How long a one-time login link (`trainyard open`) works, unused.")
    browser_session_hours: float = Field(
        24, gt=0, description="How long a browser signed in by a login link stays signed in (rotating the user's token ends it sooner)."
    )

    max_active_jobs_per_user: int | None = Field(
        100, ge=1,
        description="Most queued, scheduled and running jobs one user may have; a submit beyond it gets 429 with Retry-After. On by default on a shared service; None (in code): no limit.",
    )
    max_request_bytes: int = Field(1_000_000, gt=0, description="Largest accepted request body (uploads: max_upload_bytes).")
    max_upload_bytes: int = Field(200_000_000, gt=0, description="Largest dataset file or code bundle one POST /v1/datasets or /v1/code accepts.")
    max_unpacked_bytes: int = Field(500_000_000, gt=0, description="Most bytes a code bundle may unpack to, all files together.")
    max_unpacked_files: int = Field(10_000, gt=0, description="Most files (and directories) a code bundle may hold.")
    script_packages: list[str] = Field(
        ["accelerate", "datasets", "numpy", "safetensors", "tokenizers", "torch", "transformers"],
        description="Packages the workers provide to `script` jobs: what `script.requirements` may name, besides what the job's `environment.pip` installs.",
    )
    log_tail_max: int = Field(1000, gt=0, description="Most log lines one /logs request returns.")
    metrics_max_points: int = Field(10_000, gt=0, description="Most points per series one /metrics request returns.")
    events_poll_seconds: float = Field(0.5, gt=0, description="How often an open /events or followed /logs stream looks for new items on SQLite (on PostgreSQL a NOTIFY wakes it).")
    events_heartbeat_seconds: float = Field(15.0, gt=0, description="An /events stream with nothing to send sends a comment this often, so proxies keep it open.")
    download_redirect_prefix: str | None = Field(
        None,
        pattern=r"^/[A-Za-z0-9_/-]*/$",
        description=(
            "Behind nginx: the `internal` location that serves the artifact root (deploy/nginx/trainyard.conf: "
            "`/_artifacts/`). A checkpoint download is then answered with X-Accel-Redirect once access is checked, "
            "and nginx sends the file itself (sendfile, Range). Unset: the API sends the bytes."
        ),
    )
    max_failed_auths_per_minute: int = Field(
        30, gt=0, description="Wrong bearer tokens one client address may send per minute (counted across API processes with the Redis broker); past that its requests that bring no right token get 429 with Retry-After until the minute is over (a right token is served)."
    )
    api_reports_per_second: float = Field(
        100.0, gt=0,
        description="Reports of running attempts the API processes take per second, all together, before they ask hosts to "
        "report less often (each running attempt's host then reports every running attempts / this many seconds, its points "
        "batched meanwhile). One API process on a core of its own takes about 200 requests a second (bench/agents.py); raise it "
        "with more API processes.",
    )
    max_streams_per_user: int = Field(
        50, gt=0, description="Most followed /events and /logs streams one user may have open at once (across API processes with the Redis broker, else on the one); another gets 429."
    )


class SchedulerSettings(_FromEnvironment):
    """The scheduler: how often it runs, how it orders the queue, and when it gives up on a host or
    a dispatch (the API shows hosts as online by the same host timeout; workers wait out the
    dispatch timeout for a gang's node 0)."""

    scheduler_interval_seconds: float = Field(
        2.0, gt=0,
        description="Longest pause between scheduler passes, which find expired leases and re-send unclaimed dispatches; "
        "a ring (a job queued, devices freed, a host registered) starts one at once. Each pass costs the host a few ms "
        "of CPU, taken from CPU training beside it.",
    )
    priority_aging_seconds: float = Field(600.0, gt=0, description="A queued job gains one priority point per this many seconds waited.")
    fair_share_weight: float = Field(
        10.0, ge=0,
        description="Priority points fair share is worth: a waiting job's order adds this × its fair-share factor (1 for a team "
        "and user that used nothing lately, 0.25 for one at its entitlement, towards 0 above it); 0: priority and age alone.",
    )
    small_job_weight: float = Field(
        0.0, ge=0,
        description="Priority points a small job is worth (Slurm's job size factor with PriorityFavorSmall): a waiting job of n "
        "slots (nodes × processes) adds this / n, so a burst of large jobs doesn't hold every 1-slot job back for hours; the "
        "first job that must wait still gets hosts held for it, so large ones are not starved. 0: size doesn't count.",
    )
    fair_share_half_life_seconds: float = Field(
        7 * 24 * 3600.0, gt=0, description="Usage counts for fair share with this half-life (Slurm's PriorityDecayHalfLife): a week ago, half."
    )
    fair_share_update_seconds: float = Field(
        30.0, ge=0, description="How often the scheduler adds the attempts' running time to the decayed usage fair share orders by."
    )
    host_timeout_seconds: float = Field(30.0, gt=0, description="A host silent for this long gets no new attempts.")
    dispatch_timeout_seconds: float = Field(60.0, gt=0, description="A scheduled attempt not claimed for this long is dispatched again.")


class WorkerSettings(_FromEnvironment):
    """The workers: how they reach the service, how often they show they are alive, and how long an
    attempt is theirs without it (a worker follows the service's heartbeat, lease, runtime and log
    settings, which it learns as it registers)."""

    api_url: str = Field("http://127.0.0.1:8000", description="Workers: the service's API, which they speak the worker protocol to (api_schemas/host_api.py).")
    host_token: str | None = Field(None, description="Workers: this host's own token (`trainyard host token NAME`); or host_token_file.")
    host_token_file: Path | None = Field(None, description="Workers: a file holding this host's token (kept off the environment of its processes).")

    heartbeat_seconds: float = Field(
        5.0, gt=0, description="How often workers renew attempt leases (a renewal is its host's heartbeat); an idle host heartbeats "
                               "every third of host_timeout_seconds, or this often if that is shorter.",
    )
    lease_seconds: float = Field(30.0, gt=0, description="A running attempt whose lease is not renewed for this long is lost.")
    control_plane_ports: list[int] = Field(
        [8000], description="Ports of the service's own (its API's; the database's and broker's are read from their URLs) "
        "that a root worker closes to jobs keeping the host's network (multi-node gangs), on any address (workers/egress.py).",
    )
    max_runtime_hours: float = Field(
        168.0, gt=0, description="Longest an attempt runs (wall clock) when its spec doesn't say (resources.max_runtime_hours); "
        "past it the training is stopped and the job fails saying so.",
    )
    memory_gb_per_slot: float | None = Field(
        None, gt=0, description="Memory an attempt may use on a host for each process slot it holds, unless its spec says "
        "(resources.memory_gb); its CPU is bounded the same way, to its slots' cores. None: the host's memory divided by its "
        "slots. Enforced where the worker has cgroups (workers/limits.py).",
    )
    max_attempt_disk_gb: float = Field(
        100.0, gt=0, description="Most an attempt's directory may hold on a host (what it writes: checkpoints, outputs, "
        "files) unless its spec says (resources.disk_gb); past it the training is stopped and the job fails saying so.",
    )
    fetch_cache_gb: float = Field(
        20.0, ge=0, description="A host without the shared store (shared_artifact_store false): most its cache of files fetched "
        "through the API (data, resume checkpoints, code; workers/store_access.py) keeps of those no attempt uses now.",
    )
    failed_attempt_retention_hours: float = Field(
        24.0, ge=0, description="How long a worker keeps the directory of a failed or lost attempt for someone to look into; "
        "others' are removed 10 minutes after they end (workers/attempt_dirs.py).",
    )
    max_log_lines_per_attempt: int = Field(
        1_000_000, gt=0, description="Output lines stored of one attempt (on each node); past it lines are dropped, and a line "
        "in the job's logs says so and, at the end, how many. Lines of up to 4,000 characters each.",
    )
    # Where a job's `environment.pip` comes from: uv's own defaults (PyPI) unless set, so a host
    # without internet access is pointed at a local mirror or a directory of wheels.
    environment_index_url: str | None = Field(None, description="The package index uv installs `environment.pip` from; None: PyPI.")
    environment_find_links: list[str] = Field(
        [], description="Directories or URLs of wheels uv also installs from (JSON list in the environment variable)."
    )
    environment_no_index: bool = Field(False, description="Install from environment_find_links only, never an index (an offline host).")
    environment_max_bytes: int = Field(
        20 * 2**30, gt=0, description="Most bytes the cached environments of one host take; past it the least recently used ones not in use are deleted."
    )
    warm_interpreters: int = Field(
        1, ge=0, description="Interpreters each worker keeps loaded (torch and accelerate imported) for the next attempts to start "
        "from (workers/warm_pool.py); each holds a few hundred MB of memory while it waits. 0: every attempt starts cold.",
    )


class SlurmSettings(_FromEnvironment):
    """The scheduler: a Slurm cluster to hand jobs to (service/backends/slurm.py), as the pool that
    jobs name with `resources.pool`. It calls Slurm's commands (sbatch, squeue, scancel, sinfo), so it
    runs where they reach the cluster (a login or submit node), or, with `slurm_rest_url`, the
    cluster's slurmrestd with a JWT from anywhere that reaches it; the compute nodes need the shared
    storage below and the API's URL, never the database."""

    slurm_partition: str | None = Field(None, description="The partition jobs are submitted to; unset: no Slurm pool.")
    slurm_pool: str = Field("slurm", pattern=r"^[a-z][a-z0-9-]{0,39}$", description="The pool's name, as jobs give it in `resources.pool`.")
    slurm_account: str | None = Field(None, description="sbatch --account; unset: the submitting user's default.")
    slurm_qos: str | None = Field(None, description="sbatch --qos; unset: the partition's default.")
    slurm_bin_dir: Path | None = Field(None, description="Where sbatch, squeue, scancel and sinfo are; unset: PATH.")
    slurm_python: str | None = Field(
        None, description="The Python with Trainyard installed that the compute nodes run the agent with, on the shared "
        "software path; unset: the scheduler's own.",
    )
    slurm_api_url: str | None = Field(None, description="The API's URL as the compute nodes reach it; unset: api_url.")
    slurm_rest_url: str | None = Field(
        None, pattern=r"^https?://", description="slurmrestd's URL (http://host:6820): Slurm is reached through it, not its "
        "commands (service/backends/slurm_rest.py); needs slurm_jwt_file.",
    )
    slurm_jwt_file: Path | None = Field(
        None, description="A file holding the JWT for slurmrestd (`scontrol token username=… lifespan=…`'s output); read at "
        "every request, so a renewed token is written there with no restart.",
    )
    slurm_user: str | None = Field(None, description="The user the JWT is for, whose jobs these are; unset: the scheduler's own user.")

    @model_validator(mode="after")
    def _rest_needs_a_token(self):
        if self.slurm_rest_url and not self.slurm_jwt_file:
            raise ValueError("TRAINYARD_SLURM_JWT_FILE: required with TRAINYARD_SLURM_REST_URL (slurmrestd takes a JWT)")
        return self


class Settings(StorageSettings, LoggingSettings, ApiSettings, SchedulerSettings, WorkerSettings, SlurmSettings):
    """Every group in one object (the same names, `settings.lease_seconds`)."""


@lru_cache
def get_settings() -> Settings:
    return Settings()


# TRAINYARD_ variables that name no setting and are not mistakes: the client's, the shipped
# deployments' secrets, what a job's processes are given, the test suite's and benchmarks'.
OTHER_VARIABLES = {"TRAINYARD_SERVER", "TRAINYARD_TOKEN", "TRAINYARD_CONFIG", "TRAINYARD_DB_PASSWORD", "TRAINYARD_REDIS_PASSWORD",
                   "TRAINYARD_EVENTS_FILE", "TRAINYARD_CHECKPOINT_DIR", "TRAINYARD_RESUME_FROM"}
OTHER_PREFIXES = ("TRAINYARD_TEST_", "TRAINYARD_BENCH_")
ABBREVIATIONS = {"DB": "DATABASE", "DIRECTORY": "DIR", "SECS": "SECONDS", "SEC": "SECONDS", "S": "SECONDS"}


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """What to warn of: each TRAINYARD_ variable that names no setting, with the nearest that does.
    A misspelt TRAINYARD_DB_URL was ignored in silence, and the API ran on a SQLite file of its own."""
    known = {name.upper() for name in Settings.model_fields}
    said = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("TRAINYARD_") or upper in OTHER_VARIABLES or upper.startswith(OTHER_PREFIXES):
            continue
        setting = upper.removeprefix("TRAINYARD_")
        if setting in known:
            continue
        spelt_out = "_".join(ABBREVIATIONS.get(word, word) for word in setting.split("_"))
        near = difflib.get_close_matches(spelt_out, known, n=1, cutoff=0.7)
        said.append(f"{name} is no setting of Trainyard's, ignored" + (f" (did you mean TRAINYARD_{near[0]}?)" if near else ""))
    return said
