"""The worker protocol over HTTP: what a worker host says to the service, and what it hears back.

It is the one contract between `service/` and `workers/`. A host authenticates with its own host
token (`trainyard host token NAME`), which acts only as that host, and only on the attempts placed
on it; no database credential reaches a machine that runs user code. The routes, all under
`/v1/host/` (service/api/routes/host_api.py):

    POST register             HostRegistration → HostTerms     (start: devices, address; the service's timing back)
    POST heartbeat            → 204                             (alive; every idle_heartbeat_seconds with no lease to renew)
    POST deregister           → 204                             (shutting down: no more attempts)
    POST attempts/{id}/claim  ClaimRequest → ClaimedAttempt     (409: not ours to run; a duplicate dispatch)
    POST attempts/{id}/lease  LeaseRequest → Lease              (renew; learn of a cancel or preemption)
    POST attempts/{id}/rendezvous  LeaseRequest → Rendezvous    (a gang's node 0's host:port, lease renewed)
    POST attempts/{id}/environment EnvironmentReport → 204      (what it runs with: inputs' digests, packages, device)
    POST attempts/{id}/report      Report → Reported            (metrics, log lines, refused transfers; the lease renewed, when asked)
    POST attempts/{id}/checkpoints CheckpointStored → 204       (a checkpoint taken into the store)
    POST attempts/{id}/outputs     OutputStored → 204           (a script's output folder taken into the store)
    POST attempts/{id}/finish      AttemptEnd → Finished        (how it ended)

A host that does not share the artifact store's filesystem (TRAINYARD_SHARED_ARTIFACT_STORE=false)
moves its files through the API instead, each file resumable after a cut, each item verified
against its manifest before it is listed:

    GET  attempts/{id}/uploads/{upload}/{path}       → Transferred    (how much of a file has arrived)
    PUT  attempts/{id}/uploads/{upload}/{path}?offset=N  bytes → Transferred  (written at N, the rest dropped)
    POST attempts/{id}/uploads/{upload}/checkpoint  CheckpointSeal → StoredItem  (verified, moved into the store)
    POST attempts/{id}/uploads/{upload}/output      OutputSeal → StoredItem      (the same, for a script's output)
    GET  attempts/{id}/files/{resume|code}           → DirectoryListing  (the checkpoint it resumes from, a script's code)
    GET  attempts/{id}/files/{resume|code}/{path}    → bytes (Range)     (one file of it)

A sealed item is then registered with `checkpoints` / `outputs` as a shared host's is.

Every attempt route names the lease its host holds: one that has lost it (reaped as lost, a newer
claim) gets `held: false` or 409, and stops. Everything a host sends is idempotent, so a request
whose answer was lost is simply sent again: metrics by (job, step, name), log lines by their
sequence number in the attempt, checkpoints by their path in the store.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field

from api_schemas.run_record import RunEnvironment

HOST_API_PREFIX = "/v1/host"
# A cluster agent that could not reach the API as its allocation started leaves this file in its
# try's directory (beside its token): the scheduler then takes the attempt as lost (tried again),
# not as failed by an agent that can't start.
UNREACHABLE_FILE = "api-unreachable"

# What one report may carry: a host sends a backlog in batches of at most these (ours sends a fifth: workers/supervisor.py).
MAX_POINTS_PER_REPORT = 20_000
MAX_LINES_PER_REPORT = 5_000
MAX_LINE_CHARS = 4_000
MAX_REFUSED_PER_REPORT = 100
MAX_METRIC_NAME_CHARS = 64  # as the database keeps a metric's name
# Steps, sequence numbers and ranks are kept as 32-bit integers: one past them is refused (422), not stored.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
MetricName = Annotated[str, Field(max_length=MAX_METRIC_NAME_CHARS)]
LogLine = Annotated[str, Field(max_length=MAX_LINE_CHARS)]
MAX_WHAT_CHARS = 1_000  # a refused item's name (its folder, or the output's name)

LeaseOwner = Field(min_length=1, max_length=200)


# A worker host's name, as its `--host-name` and `trainyard host token` give it: a hostname.
HOST_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class HostRegistration(BaseModel):
    """What a starting host offers."""

    device: Literal["cpu", "cuda"]
    slots: int = Field(ge=1, le=4096, description="GPUs, or CPU process slots.")
    address: str = Field(min_length=1, max_length=200, description="Where the other hosts of a multi-node job reach this one.")
    info: dict[str, Any] = Field(default_factory=dict, description="gpus (index, name, memory_gb), sandbox: shown in GET /v1/workers.")
    instance: str | None = Field(
        None, max_length=64,
        description="This worker process's own id: while a host registered by another lives (heartbeats), a second is refused (409).",
    )
    name: str | None = Field(
        None, pattern=HOST_NAME_PATTERN,
        description="The name the host was started under (`--host-name`): refused (403) if it is not its token's host, whose "
                    "queue it would not consume.",
    )


class HostTerms(BaseModel):
    """The service's timing and limits, which a host follows: one place sets them for every host."""

    heartbeat_seconds: float = Field(description="How often a host renews each lease it holds (a renewal is its heartbeat too).")
    idle_heartbeat_seconds: float | None = Field(
        None, description="How often a host renewing no lease heartbeats: a third of the host timeout, so three go missing before it is "
                          "taken for offline (None: every heartbeat_seconds). An idle fleet's heartbeats are most of a large one's requests.",
    )
    lease_seconds: float
    dispatch_timeout_seconds: float
    max_log_lines_per_attempt: int
    max_runtime_hours: float
    max_attempt_disk_gb: float = Field(100.0, description="What an attempt's directory may hold unless its spec says (resources.disk_gb).")
    attempt_subnet: str | None = Field(
        None, description="The /24 this host's gang attempts take their addresses from, when it makes gang networks (its info said so)."
    )
    control_plane_ports: list[int] = Field(
        description="The service's ports (database, broker, API) that a host closes to its multi-node jobs (workers/egress.py)."
    )
    artifact_mark: str | None = Field(None, description="The id in the artifact root's mark file: a host sharing the store must read the same.")
    data_mark: str | None = Field(None, description="The same of the data root.")
    artifact_reader_gid: int | None = Field(
        None, description="The group a host sharing the store gives read access to the checkpoints it moves in (a proxy's, that sends downloads)."
    )


class EnvironmentReport(BaseModel):
    """What the attempt runs with, for its job's run record (api_schemas/run_record.py)."""

    lease_owner: str = LeaseOwner
    environment: RunEnvironment


class ClaimRequest(BaseModel):
    lease_owner: str = LeaseOwner
    rendezvous: str | None = Field(None, max_length=200, description="host:port this host's node 0 of a gang would listen on.")


class ClaimedAttempt(BaseModel):
    """An attempt this host now runs, under `lease_owner`'s lease."""

    attempt_id: int
    number: int
    node_rank: int
    job_id: int
    spec: dict[str, Any]
    slots: int
    device_ids: list[int] | None
    lease_owner: str
    resume_checkpoint_path: str | None = Field(description="The checkpoint to resume from, relative to the artifact store.")
    resume_step: int | None
    code_path: str | None = Field(None, description="A script job's code directory, on the storage hosts share with the service.")
    code_refused: str | None = Field(None, description="Why a script job's code can't be had (gone, outside the code root), in place of code_path.")
    skip_steps: int = Field(0, description="After a rollback: train on past the batches of this many steps after the resume checkpoint's.")
    net_address: str | None = Field(
        None, description="A gang's attempt on hosts that make gang networks: its own address (its rendezvous is there), "
        "in a network namespace of its own that reaches only its gang (workers/gang_network.py)."
    )


class LeaseRequest(BaseModel):
    lease_owner: str = LeaseOwner


class Lease(BaseModel):
    held: bool = Field(description="False once the attempt is no longer this host's (reaped as lost, revoked): stop it.")
    cancel_requested: bool
    preempt_requested: bool = False
    preempt_reason: str | None = Field(None, description="Why the scheduler wants the attempt stopped at a checkpoint, when it said.")


class GangNode(BaseModel):
    node_rank: int
    address: str = Field(description="The attempt's own address (ClaimedAttempt.net_address).")
    host_address: str = Field(description="Its host's: the route to the attempt's /24 goes through it.")


class Rendezvous(BaseModel):
    rendezvous: str | None = Field(description="host:port of node 0 of the gang's try, once it has claimed; None until then.")
    lease: Lease
    gang: list[GangNode] | None = Field(None, description="Every node of a gang in gang networks, once all have claimed; None until then, or on hosts' networks.")


class Report(BaseModel):
    """What an attempt produced since the last report: sent again, whole, if its answer was lost."""

    lease_owner: str = LeaseOwner
    metrics: list[tuple[Int32, MetricName, float | None]] = Field(
        default_factory=list, max_length=MAX_POINTS_PER_REPORT, description="(step, name, value); None for NaN or infinite."
    )
    logs: list[tuple[Int32, Int32 | None, LogLine]] = Field(
        default_factory=list, max_length=MAX_LINES_PER_REPORT, description="(sequence number in the attempt, rank, line)."
    )
    refused: list[RefusedTransfer] = Field(default_factory=list, max_length=MAX_REFUSED_PER_REPORT)
    resent: bool = Field(
        False, description="The host sent some of this before and lost the answer: points stored already with the "
        "same value are not announced again (no step twice in the job's events)."
    )
    renew_lease: bool = Field(
        False, description="Renew the lease too, as `attempts/{id}/lease` would (the answer's `lease`): a host with "
        "something to report when its heartbeat is due sends the renewal with it, not in a request of its own."
    )


class Reported(BaseModel):
    """The answer to a report: when to send the next one, and the lease when the report renewed it."""

    next_report_seconds: float = Field(
        0.0, ge=0, description="Send this attempt's next report no sooner than this (what is new meanwhile waits, batched): "
        "0 while the API takes every report at once; more as more hosts report, so that each sends fewer, larger reports "
        "and none waits in a queue at the API (settings: api_reports_per_second)."
    )
    lease: Lease | None = Field(None, description="The renewed lease, when the report asked for it (`renew_lease`).")


class RefusedTransfer(BaseModel):
    """A checkpoint or output the artifact store refused (incomplete, corrupt): an event of the job, never silently dropped."""

    kind: Literal["checkpoint_refused", "output_refused"]
    step: Int32 | None
    what: str = Field(max_length=MAX_WHAT_CHARS)
    reason: str = Field(max_length=MAX_LINE_CHARS)


class CheckpointStored(BaseModel):
    lease_owner: str = LeaseOwner
    step: int = Field(ge=0, le=INT32_MAX)
    path: str = Field(max_length=1000, description="Where it is in the artifact store, relative to its root.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0, le=2**63 - 1)


class OutputStored(BaseModel):
    lease_owner: str = LeaseOwner
    name: str = Field(max_length=1000)
    step: Int32 | None
    path: str = Field(max_length=1000)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0, le=2**63 - 1)
    files: int = Field(ge=0, le=INT32_MAX)


MAX_UPLOAD_PART_BYTES = 16 << 20  # one PUT of a file sent through the API: a cut costs at most this much sent again


def is_upload_part(path: str) -> bool:
    """A request path that PUTs part of a file of an upload (its body may be up to MAX_UPLOAD_PART_BYTES)."""
    parts = path.split("/")
    return path.startswith(f"{HOST_API_PREFIX}/attempts/") and len(parts) > 7 and parts[5] == "uploads"


UPLOAD_ID_PATTERN = r"^[0-9a-f]{32}$"  # the host's name for one item's upload: a uuid4's hex


def inside_path(path: str) -> str:
    """A path inside a directory, as the store's items name their files and folders: relative, in
    POSIX form, with no empty, `.` or `..` part (so it can't name anything outside)."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or "\0" in path or any(part in ("", ".", "..") for part in parts):
        raise ValueError("must be a relative path with no empty, '.' or '..' parts")
    return path


InsidePath = Annotated[str, Field(min_length=1, max_length=1000), AfterValidator(inside_path)]
FILE_KINDS = ("resume", "code", "data")  # what an attempt may read through the API: its resume checkpoint, a script's code, its data inputs


class Transferred(BaseModel):
    received: int = Field(ge=0, description="Bytes of the file the service holds; the next write starts there.")


class CheckpointSeal(BaseModel):
    """The upload holds a whole checkpoint (its manifest.json among its files): verify it and take it in."""

    lease_owner: str = LeaseOwner
    step: int = Field(ge=0, le=INT32_MAX)
    folder: InsidePath = Field(description="Its folder under the job's checkpoints (`step-…`; a script's `attempt-N.K/its own name`).")


class OutputSeal(BaseModel):
    """The upload holds a script's output: `name/…` beside the manifest.json of its files."""

    lease_owner: str = LeaseOwner
    name: InsidePath = Field(description="The output's path in the script's working directory, as its spec names it.")
    step: Int32 | None


class StoredItem(BaseModel):
    """Where a sealed upload now is in the store, as a shared host's take would say it."""

    path: str
    sha256: str
    size: int
    files: int


class ListedFile(BaseModel):
    size: int
    sha256: str


class DirectoryListing(BaseModel):
    """The files of a stored directory an attempt reads (relative POSIX paths), to fetch and verify each."""

    files: dict[str, ListedFile]


class Rollback(BaseModel):
    """What the loss guard saw (api_schemas/worker_protocol.py SpikeEvent): the job goes on from its
    last checkpoint before `first_step`, past the batches of the steps through `last_step`."""

    first_step: int = Field(ge=1)
    last_step: int = Field(ge=1)
    reason: str = Field(max_length=1000)
    drop: list[Annotated[str, Field(max_length=1000)]] | None = Field(
        None, max_length=10_000, description="A script's: the store paths of its attempt's checkpoints saved after the "
        "spike began (in the order it wrote them: their steps are its own numbering), to drop; none skipped past. "
        "None (the built-in loop, and a custom one, whose checkpoints and metrics share the context's steps): every checkpoint "
        "of `first_step` and after, and the batches through `last_step` skipped.",
    )


class AttemptEnd(BaseModel):
    lease_owner: str = LeaseOwner
    outcome: Literal["succeeded", "failed", "cancelled", "preempted"] = Field(
        description="How it ended (lost is the scheduler's to say, when a lease runs out)."
    )
    reason: str | None = Field(None, max_length=100_000)
    retry: bool = Field(True, description="False: no retry can mend it (the spec can't run), the job fails at once.")
    rollback: Rollback | None = Field(None, description="With `preempted`: the loss guard stopped it; roll the job back.")


class Finished(BaseModel):
    ended: bool = Field(description="False: too late, the lease was lost before the end was recorded.")


Report.model_rebuild()
