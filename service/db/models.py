"""Database tables. The database is the source of truth for jobs, attempts, metrics and checkpoints."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, TypeDecorator, BigInteger, Boolean, DateTime, Enum, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from api_schemas import AttemptStatus, JobEventType, JobStatus, SweepStatus
from service.db import rollups


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class UTCDateTime(TypeDecorator):
    """Timestamps in UTC; SQLite stores them without a zone, so the zone is restored on load."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


def _enum_column(enum_type, length: int = 16):
    # Stored as the plain value string (no native enum type to migrate), loaded back as the enum.
    return Enum(enum_type, native_enum=False, length=length, values_callable=lambda e: [m.value for m in e])


# SQLite has no BIGSERIAL; BigInteger primary keys only autoincrement there as INTEGER.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    can_run_code: Mapped[bool] = mapped_column(
        Boolean, default=False, doc="May submit `script` jobs, which run the user's own code on worker hosts."
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    token_lifetime_s: Mapped[int | None] = mapped_column(
        Integer, nullable=True, doc="How long each of this user's tokens is valid; None: until rotated or revoked."
    )
    token_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, doc="Set by `trainyard user revoke`: no token of this user works.")


class Team(Base):
    """Users who share a nominal quota of devices; beyond it they borrow what is idle (service/fair_share.py)."""

    __tablename__ = "teams"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    quota: Mapped[dict] = mapped_column(JSON, doc="Process slots per device kind ({'cuda': 8}): the team's nominal quota.")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TeamMember(Base):
    __tablename__ = "team_members"
    team_id: Mapped[int] = mapped_column(ForeignKey("teams.id"), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), primary_key=True, index=True)
    is_default: Mapped[bool] = mapped_column(Boolean, default=False, doc="The user's jobs that name no team run under this one.")


class FairShareUsage(Base):
    """One row: each (user, team, device kind)'s usage in device-seconds, decayed with the fair-share
    half-life up to `updated_at` (service/fair_share.py). Kept up by the scheduler as attempts run,
    so a pass never re-reads a month of attempts."""

    __tablename__ = "fair_share_usage"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    usage: Mapped[dict] = mapped_column(JSON, doc="'user_id:team_id:device' (team_id 0: no team) -> decayed device-seconds.")
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AuditEntry(Base):
    """One mutating request or code job: who did what, when, from where, and how it was answered.
    The name is kept as well as the id: the entry outlives a renamed or revoked user."""

    __tablename__ = "audit_entries"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    user_id: Mapped[int | None] = mapped_column(BigId, nullable=True, index=True, doc="None: the caller was not authenticated.")
    user_name: Mapped[str | None] = mapped_column(String(100), nullable=True)
    client_address: Mapped[str] = mapped_column(String(100))
    method: Mapped[str] = mapped_column(String(10))
    path: Mapped[str] = mapped_column(String(500))
    status_code: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[int | None] = mapped_column(BigId, nullable=True, doc="The job the request submitted or acted on, where one is known.")
    detail: Mapped[str | None] = mapped_column(String(500), nullable=True, doc="What the request did, in words, e.g. `script job`.")


class Upload(Base):
    """A file a user uploaded: a dataset (one file under the data root) or a code bundle (unpacked
    under the artifact root). `path` is relative to that root; the files are in place before the row exists."""

    __tablename__ = "uploads"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16), doc="`dataset` or `code`.")
    name: Mapped[str] = mapped_column(String(200), doc="The file name the user gave.")
    sha256: Mapped[str] = mapped_column(String(64), doc="sha256 of the uploaded bytes (the archive, for code).")
    size_bytes: Mapped[int] = mapped_column(BigInteger, doc="Size of the uploaded bytes.")
    path: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Sweep(Base):
    """A hyperparameter search. Its trials are jobs with its `sweep_id`; the Optuna study is rebuilt
    from them each time the controller (service/sweeps.py) acts, so this row and theirs are all there is."""

    __tablename__ = "sweeps"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    spec: Mapped[dict] = mapped_column(JSON, doc="The SweepSpec as submitted.")
    status: Mapped[SweepStatus] = mapped_column(_enum_column(SweepStatus), default=SweepStatus.running)
    failure_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    owner: Mapped[User] = relationship(lazy="joined")

    __table_args__ = (Index("ix_sweeps_status", "status"),)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    spec: Mapped[dict] = mapped_column(JSON)
    status: Mapped[JobStatus] = mapped_column(_enum_column(JobStatus), default=JobStatus.queued)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    max_steps: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    failure_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    waiting_reason: Mapped[str | None] = mapped_column(String(500), nullable=True, doc="Why the scheduler has not placed it yet.")
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    queued_at: Mapped[datetime | None] = mapped_column(
        UTCDateTime, nullable=True, doc="When it was last queued again after an attempt; None: queued since created_at."
    )
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_event_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0", doc="seq of the job's newest JobEvent.")
    sweep_id: Mapped[int | None] = mapped_column(ForeignKey("sweeps.id"), nullable=True, doc="The sweep this job is a trial of.")
    trial_number: Mapped[int | None] = mapped_column(Integer, nullable=True, doc="Its number in the sweep: inserted with the job, once.")
    trial: Mapped[dict | None] = mapped_column(
        JSON, nullable=True, doc="The trial as Optuna knows it: `params`, `system_attrs` (a pruner's rungs), `checked_step`."
    )
    prune_reason: Mapped[str | None] = mapped_column(
        Text, nullable=True, doc="Set when the sweep prunes it: however its attempt then ends, the job ends `pruned` with this."
    )
    rollbacks: Mapped[int] = mapped_column(Integer, default=0, server_default="0", doc="Times its loss guard rolled it back.")
    rollback_skip: Mapped[dict | None] = mapped_column(
        JSON, nullable=True,
        doc="After a rollback, until it checkpoints past it: {'resume_step', 'through_step'}: resuming from the checkpoint at "
        "resume_step, skip the batches of the steps through through_step.",
    )
    team_id: Mapped[int | None] = mapped_column(
        ForeignKey("teams.id"), nullable=True, index=True, doc="The team whose quota and fair share it runs under; None: no team."
    )

    owner: Mapped[User] = relationship(lazy="joined")
    attempts: Mapped[list[Attempt]] = relationship(back_populates="job", order_by="Attempt.number", lazy="selectin")

    @property
    def planned_steps(self) -> int | None:
        """max_steps as the API shows it: None for a script job that gave none (stored as 0)."""
        return self.max_steps or None

    __table_args__ = (
        Index("ix_jobs_queue", "status", "priority", "id"),
        UniqueConstraint("owner_id", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        UniqueConstraint("sweep_id", "trial_number", name="uq_jobs_sweep_trial"),
    )


class Attempt(Base):
    """One try at running a job on a host. The worker owns it while its lease is fresh."""

    __tablename__ = "attempts"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    node_rank: Mapped[int] = mapped_column(Integer, default=0, doc="Which host of a multi-node gang; attempts of one try share `number`.")
    host_name: Mapped[str] = mapped_column(String(200), index=True)
    slots: Mapped[int] = mapped_column(Integer)
    status: Mapped[AttemptStatus] = mapped_column(_enum_column(AttemptStatus), default=AttemptStatus.scheduled)
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    rendezvous: Mapped[str | None] = mapped_column(String(200), nullable=True, doc="host:port where node 0 of a gang listens; set when it claims.")
    net_address: Mapped[str | None] = mapped_column(
        String(45), nullable=True, doc="A gang's attempt: its own address in its host's /24 (workers/gang_network.py), set when it claims."
    )
    preempt_requested: Mapped[bool] = mapped_column(Boolean, default=False, doc="The scheduler wants its host back for a higher priority.")
    preempt_reason: Mapped[str | None] = mapped_column(String(300), nullable=True, doc="Why, in words (a team's quota reclaimed).")
    device_ids: Mapped[list | None] = mapped_column(JSON, nullable=True, doc="GPU indices on its host reserved for it (CUDA_VISIBLE_DEVICES); None on CPU.")
    resume_checkpoint_id: Mapped[int | None] = mapped_column(BigId, nullable=True)
    resumed_from_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    failure_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    pool: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True, doc="The cluster pool it was handed to; None: a registered host.")
    cluster_job_id: Mapped[str | None] = mapped_column(String(64), nullable=True, doc="The cluster's id for its try (a Slurm job id).")
    cluster_state: Mapped[str | None] = mapped_column(String(200), nullable=True, doc="The cluster's state for it, and why it waits.")
    run_environment: Mapped[dict | None] = mapped_column(
        JSON, nullable=True, doc="What it ran with, as its worker reported at the start (api_schemas.run_record.RunEnvironment).",
    )

    job: Mapped[Job] = relationship(back_populates="attempts")

    __table_args__ = (
        UniqueConstraint("job_id", "number", "node_rank", name="uq_attempts_job_number_node"),
        Index("ix_attempts_status", "status"),
    )


class Metric(Base):
    """One value of one named series at one step. A step recomputed after a resume overwrites its row."""

    __tablename__ = "metrics"
    job_id: Mapped[int] = mapped_column(BigId, primary_key=True, doc="No foreign key: each batch is an attempt's of the job, found first (migration 0027).")
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[float | None] = mapped_column(Float, nullable=True, doc="NULL for a NaN or infinite value.")
    attempt_id: Mapped[int] = mapped_column(BigId)


TOP_LEVEL = f"level = {rollups.LEVELS[-1]}"  # the coarsest bucket summaries


class MetricBucket(Base):
    """A `rollups.Summary` of one series over one bucket of `16 ** level` steps, kept up to date
    at ingest, so a long series is charted from a few thousand of these rather than every point."""

    __tablename__ = "metric_buckets"
    job_id: Mapped[int] = mapped_column(BigId, primary_key=True, doc="No foreign key: made of the job's metrics, which have one (migration 0006).")
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True, doc="step // 16 ** level")
    count: Mapped[int] = mapped_column(Integer)
    first_step: Mapped[int] = mapped_column(Integer)
    min_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    min_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_step: Mapped[int] = mapped_column(Integer)
    last_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    null_step: Mapped[int | None] = mapped_column(Integer, nullable=True)

    # The counts of the coarsest summaries, which add up to every point stored: the total that
    # /metrics reports (monitoring.metric_point_count) reads these instead of counting every point.
    __table_args__ = (
        Index("ix_metric_buckets_top_counts", "count", postgresql_where=text(TOP_LEVEL), sqlite_where=text(TOP_LEVEL)),
    )


class LogLine(Base):
    __tablename__ = "log_lines"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    attempt_id: Mapped[int] = mapped_column(BigId)
    attempt_number: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True, doc="Global rank of the process that printed it; None for the launcher.")
    line: Mapped[str] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("attempt_id", "seq", name="uq_log_lines_attempt_seq"),
        Index("ix_log_lines_job", "job_id", "id"),
    )


class Checkpoint(Base):
    """A checkpoint whose files are complete and verified in the artifact store."""

    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    attempt_id: Mapped[int] = mapped_column(BigId)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(500), doc="Directory relative to the artifact root.")
    sha256: Mapped[str] = mapped_column(String(64), doc="sha256 of model.safetensors.")
    size_bytes: Mapped[int] = mapped_column(BigInteger, doc="Size of model.safetensors.")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    # One row per stored directory, not per step: a script may save two folders that get one step
    # (kept apart in the store), and a resumed attempt saves the steps after its checkpoint again.
    __table_args__ = (UniqueConstraint("job_id", "path", name="uq_checkpoints_job_path"),)


class JobOutput(Base):
    """A directory a script job wrote (`script.outputs`), as last collected into the artifact store."""

    __tablename__ = "job_outputs"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    attempt_id: Mapped[int] = mapped_column(BigId)
    name: Mapped[str] = mapped_column(String(1024), doc="As script.outputs names it.")
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    path: Mapped[str] = mapped_column(String(1200), doc="Directory relative to the artifact root: manifest.json and the output under its name.")
    sha256: Mapped[str] = mapped_column(String(64), doc="sha256 of manifest.json.")
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    files: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    # The latest collection of a name replaces the one before.
    __table_args__ = (UniqueConstraint("job_id", "name", name="uq_job_outputs_job_name"),)


class DeletedCheckpoint(Base):
    """A checkpoint `keep_last` deleted, remembered so that its download can say so and name the kept ones."""

    __tablename__ = "deleted_checkpoints"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, doc="The id it had as a checkpoint.")
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    deleted_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class JobEvent(Base):
    """A job's log of what happened to it: status changes, metric points by step, checkpoints.

    `seq` numbers a job's events 1, 2, 3… with no gaps, in commit order: writers take it from the
    job row's `last_event_seq`, and that row's lock makes a second writer wait for the first to
    commit. So a reader that sees event n has seen every event before it, and can resume after n.
    """

    __tablename__ = "job_events"
    job_id: Mapped[int] = mapped_column(BigId, primary_key=True, doc="No foreign key: every write updates the job row first (migration 0006).")
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    type: Mapped[JobEventType] = mapped_column(_enum_column(JobEventType, length=32))  # 32 since migration 0017
    data: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class HostToken(Base):
    """A worker host's credential for the worker protocol (api_schemas/host_api.py): it acts as
    that host only. Kept when the host deregisters; revoked, it opens nothing (migration 0018)."""

    __tablename__ = "host_tokens"
    host_name: Mapped[str] = mapped_column(String(200), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class LoginCode(Base):
    """A one-time code a user's token asked for (`trainyard open`), exchanged once for a browser
    session: a link that signs a browser in without the token itself in a URL (migration 0021)."""

    __tablename__ = "login_codes"
    code_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[int] = mapped_column(BigId, ForeignKey("users.id"), index=True)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class BrowserSession(Base):
    """A browser's own credential, from a login code: it acts as its user until it expires, the
    user's token is rotated, or the user is revoked (migration 0021)."""

    __tablename__ = "browser_sessions"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    user_id: Mapped[int] = mapped_column(BigId, ForeignKey("users.id"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ClusterPool(Base):
    """A cluster that jobs may name as `resources.pool` (a Slurm partition): what one node of it
    offers, as its scheduler last read it (migration 0019)."""

    __tablename__ = "cluster_pools"
    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    backend: Mapped[str] = mapped_column(String(16), doc="`slurm`")
    info: Mapped[dict] = mapped_column(JSON, doc="partition, nodes, cpus_per_node, gpus_per_node, memory_mb")
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiProcess(Base):
    """An API process, as it last noted that it was up (service/db/api_processes.py, migration 0026):
    the scheduler judges a lease lost only once hosts have had an API to renew it through for a whole lease."""

    __tablename__ = "api_processes"
    name: Mapped[str] = mapped_column(String(200), primary_key=True, doc="`host:pid`")
    up_since: Mapped[datetime] = mapped_column(UTCDateTime, doc="Since when it has noted itself without a break (the database out of its reach is one).")
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime, doc="When it last noted itself.")


class SchedulerProcess(Base):
    """A scheduler process, as it last noted a pass (service/db/scheduler_processes.py, migration 0028)."""

    __tablename__ = "scheduler_processes"
    name: Mapped[str] = mapped_column(String(200), primary_key=True, doc="`host:pid`")
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime, doc="When it last made a pass that looked at leases.")


class WorkerHost(Base):
    __tablename__ = "worker_hosts"
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    device: Mapped[str] = mapped_column(String(16))
    slots: Mapped[int] = mapped_column(Integer, doc="Devices (GPUs, or CPU process slots) the host offers.")
    address: Mapped[str] = mapped_column(String(200), default="127.0.0.1", doc="Where other hosts reach it (multi-node rendezvous).")
    net_index: Mapped[int | None] = mapped_column(
        Integer, nullable=True, unique=True, doc="Which /24 of TRAINYARD_GANG_NETWORK its gangs' attempts take their addresses from."
    )
    info: Mapped[dict] = mapped_column(JSON, default=dict)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
