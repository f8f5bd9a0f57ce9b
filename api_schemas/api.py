"""Request and response models of the REST API, shared by the service, CLI and SDK."""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field

from api_schemas.jobs import JobSpec


class ErrorOut(BaseModel):
    """Every error response: a message, or for 422 the list of bad fields with their reasons."""

    detail: str | list[dict[str, Any]] | dict[str, Any]


class JobStatus(str, Enum):
    queued = "queued"
    scheduled = "scheduled"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    pruned = "pruned"  # a sweep's trial stopped early (at a checkpoint): its objective fell behind the others'

    @property
    def is_final(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled, JobStatus.pruned)


class AttemptStatus(str, Enum):
    scheduled = "scheduled"  # placed on a host, task sent, not yet claimed
    running = "running"  # claimed by a worker that renews its lease
    succeeded = "succeeded"
    failed = "failed"  # the training process exited with an error
    lost = "lost"  # the worker stopped renewing its lease, or never claimed it
    preempted = "preempted"  # its host is shutting down: it checkpointed and stopped
    cancelled = "cancelled"

    @property
    def is_final(self) -> bool:
        return self not in (AttemptStatus.scheduled, AttemptStatus.running)


class AttemptOut(BaseModel):
    id: int
    number: int
    node_rank: int = Field(0, description="Which host of a multi-node job this attempt ran on; its nodes share `number`.")
    host_name: str
    processes: int = Field(description="Processes it ran on there: the spec's, or fewer for an elastic job placed smaller.")
    status: AttemptStatus
    failure_reason: str | None
    resumed_from_step: int | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    pool: str | None = Field(None, description="The cluster pool it ran in (resources.pool); null on Trainyard's own hosts.")
    cluster_job_id: str | None = Field(None, description="The cluster's id for it (a Slurm job id), once handed to the pool.")
    cluster_state: str | None = Field(
        None, description="The cluster's state for it, with the reason a pending one waits: `PENDING (Resources)`, `RUNNING`…"
    )


class RollbackOut(BaseModel):
    """One rollback of the loss guard (training.guard): the spike it saw, and where the job went on."""

    first_step: int
    last_step: int
    resume_step: int = Field(description="The checkpoint it went on from (0: the start); the batches of the steps after it through last_step were skipped.")
    reason: str


class JobOut(BaseModel):
    id: int
    name: str
    owner: str
    status: JobStatus
    step: int = Field(description="Last optimizer step reported by the training loop.")
    max_steps: int | None = Field(description="Optimizer steps the job runs; null for a script job that gave no training.max_steps.")
    priority: int
    effective_batch_size: int | None = Field(description="Samples per optimizer step, all processes; null for a script job.")
    restarts: int = Field(
        description="Times the job was started again after an attempt failed or was lost (at most `max_restarts`); "
        "preemptions and an attempt whose host vanished before it started are not counted."
    )
    rollbacks: int = Field(0, description="Times the loss guard rolled it back from a spike or NaN (training.guard); each is a `rollback` event.")
    rollback_marks: list[RollbackOut] = Field(default_factory=list, description="Those rollbacks, oldest first.")
    failure_reason: str | None
    waiting_reason: str | None = Field(None, description="While queued: what the scheduler waits for.")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: JobSpec
    attempts: list[AttemptOut] = []
    last_train_loss: float | None = Field(None, description="train_loss at the last reported step.")
    steps_per_second: float | None = Field(None, description="Optimizer steps per second at the last reported step.")
    eta_seconds: float | None = Field(None, description="Time left at the current rate; only while running.")
    sweep_id: int | None = Field(None, description="The sweep this job is a trial of, if any.")
    trial_number: int | None = Field(None, description="Its number in that sweep.")


class JobPage(BaseModel):
    items: list[JobOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class MetricSeries(BaseModel):
    steps: list[int]
    values: list[float | None] = Field(description="null where the value was NaN or infinite (a diverged run).")


class MetricsOut(BaseModel):
    series: dict[str, MetricSeries]
    last_event_id: int = Field(0, description="The job's last event when these were read: follow /events after it for what comes next.")


class LogLineOut(BaseModel):
    attempt: int
    rank: int | None = Field(None, description="Global rank of the process that printed it; null for the launcher's own output.")
    seq: int
    line: str


class LogsOut(BaseModel):
    lines: list[LogLineOut]
    next_cursor: str = Field(description="Pass as `cursor` to read the lines written after these (a follow loop).")


class CheckpointOut(BaseModel):
    id: int
    job_id: int
    step: int
    sha256: str = Field(description="sha256 of model.safetensors (a script's checkpoint without one: of its manifest.json).")
    size_bytes: int = Field(description="Size of model.safetensors (a script's checkpoint without one: of all its files).")
    created_at: datetime
    eval_loss: float | None = Field(None, description="The job's eval_loss at this checkpoint's step, where it evaluated there.")
    best: bool = Field(
        False, description="With checkpoint.keep_best: the job's checkpoint of the best checkpoint.best_metric (by default the lowest "
        "eval_loss), kept past keep_last. Always false "
        "without it (the lowest of the checkpoints kept may be far from the job's best).",
    )
    best_value: float | None = Field(
        None, description="With checkpoint.keep_best: the job's checkpoint.best_metric at this checkpoint's step, where it was reported "
        "(what `best` ranks by; eval_loss above is shown whatever the ranking).",
    )


class OutputOut(BaseModel):
    """A directory a script job wrote (`script.outputs`), as last collected; download with GET /v1/jobs/{id}/outputs/{name}."""

    job_id: int
    name: str = Field(description="The directory as `script.outputs` names it, relative to the script's working directory.")
    step: int | None = Field(description="The job's step when it was collected (null: before any step was reported).")
    sha256: str = Field(description="sha256 of its manifest.json, which lists every file's size and sha256.")
    size_bytes: int = Field(description="Total size of its files.")
    files: int = Field(description="Number of files.")
    created_at: datetime


class UploadOut(BaseModel):
    """An uploaded dataset file or code bundle, usable by its owner's jobs by `id`."""

    id: int
    kind: str = Field(description="`dataset` or `code`.")
    name: str = Field(description="The file name given at upload.")
    sha256: str = Field(description="sha256 of the uploaded bytes.")
    size_bytes: int
    created_at: datetime


class JobEventType(str, Enum):
    status = "status"  # data: {"status", "reason"}
    metrics = "metrics"  # data: {"step", "values": {name: value}}, the points of one step as they were recorded
    checkpoint = "checkpoint"  # data: {"checkpoint_id", "step", "sha256", "size_bytes"}
    # A checkpoint or script output the artifact store refused (a link in it, a missing manifest…):
    # data: {"step", "what" (its folder, or the output's name), "reason"}. Not stored, so no resume from it.
    checkpoint_refused = "checkpoint_refused"
    output_refused = "output_refused"
    # The loss guard stopped a diverging run (workers/loss_guard.py): data: {"first_step",
    # "last_step", "resume_step" (the checkpoint it goes on from; 0: the start), "reason", "rollbacks"}.
    rollback = "rollback"


class JobEventOut(BaseModel):
    """One event of GET /v1/jobs/{id}/events, sent as the `data` of an SSE message of the same id and type."""

    id: int = Field(description="1, 2, 3… per job, in commit order; send the last one seen as Last-Event-ID to resume.")
    type: JobEventType
    at: datetime
    data: dict[str, Any]


class HostAttemptOut(BaseModel):
    """What occupies part of a host."""

    job_id: int | None = Field(description="null when the job is another user's.")
    node_rank: int
    slots: int
    gpus: list[int] | None = Field(description="GPU indices reserved for it; null on CPU.")
    status: AttemptStatus


class PoolOut(BaseModel):
    """A cluster pool jobs may name as `resources.pool`: what one node of it offers."""

    name: str
    backend: str = Field(description="`slurm`")
    partition: str | None
    nodes: int = Field(description="Nodes in the partition: the most a job may ask for.")
    cpus_per_node: int
    gpus_per_node: int
    memory_mb: int
    max_minutes: int | None = Field(None, description="The partition's time limit (MaxTime), in minutes; null for none. A job runs at most this long there.")
    seen_at: datetime = Field(description="When the scheduler last read it from the cluster.")


class WorkerOut(BaseModel):
    name: str
    address: str
    device: str
    slots: int
    busy_slots: int
    gpus: list[dict[str, Any]] = Field(description="For cuda hosts: index, name and memory_gb of each GPU.")
    sandbox: str = Field(description="What its attempts run in: bubblewrap, unavailable (code-running jobs refused) or none (opted out).")
    attempts: list[HostAttemptOut] = Field(description="Attempts placed or running here now.")
    online: bool
    last_heartbeat: datetime


class RunningJobOut(BaseModel):
    id: int
    name: str
    owner: str
    step: int
    max_steps: int | None = Field(description="null for a script job that gave no training.max_steps.")
    progress: float | None = Field(description="step / max_steps; null when max_steps is.")
    last_train_loss: float | None
    host_name: str | None


class DashboardOut(BaseModel):
    jobs_by_status: dict[str, int]
    running: list[RunningJobOut]
    workers: list[WorkerOut]
    scheduler_down: str | None = Field(None, description="Set while no scheduler makes passes: nothing is placed meanwhile.")
