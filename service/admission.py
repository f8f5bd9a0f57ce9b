"""Admission: whether a job spec may enter the queue, decided at submit.

The schema (api_schemas) has checked each field's form. What needs the service's state is checked
here, so that a spec naming something missing is refused at once instead of failing an attempt:
the caller may run code (a script job), what the spec names exists and is the caller's (uploads,
data files, plugin modules, code and its requirements), some registered host could ever run it,
the team it names is one of the caller's, and the caller is within the active-job quota. A sweep's base spec is checked as a job's, and its
trials are admitted as jobs. A refusal is a `Refused`; the API answers it.
"""

from __future__ import annotations

from http import HTTPStatus

from packaging.requirements import InvalidRequirement
from pydantic import ValidationError
from sqlalchemy.orm import Session

from api_schemas import JobSpec, ResourcesConfig, ScriptConfig, SweepSpec
from api_schemas.requirements import package_name
from service.datasets import DatasetError, check_spec_paths
from service.db.hosts import all_hosts
from service.db.jobs import KeyReused, QuotaExceeded, TrialOf, create_job
from service.db.pools import all_pools, pool_named
from service.db.uploads import upload_visible_to
from service.db.models import Job, Sweep, Team, User
from service.db.teams import TeamError, team_for_job
from service.db.sweeps import create_sweep
from service.placement import never_fits
from common.settings import Settings
from service.sweep_space import NoSuchField, with_params
from service.uploads import CODE, DATASET, UploadRefused, code_directory

# Jobs run for minutes to days; a client over its quota has no reason to ask again sooner.
QUOTA_RETRY_AFTER_SECONDS = 60


class Refused(Exception):
    """A request the service won't take: the HTTP `status`, the body `field` at fault (None: the
    request as a whole) and the `message` for the caller; a refusal that passes with time says
    when to ask again (`retry_after`, seconds) and the numbers behind it (`facts`)."""

    def __init__(
        self, status: int, field: tuple[str, ...] | None, message: str, retry_after: int | None = None, facts: dict | None = None
    ):
        super().__init__(message)
        self.status, self.field, self.message = status, field, message
        self.retry_after, self.facts = retry_after, facts or {}


def bad_field(field: tuple[str, ...], message: str) -> Refused:
    return Refused(HTTPStatus.UNPROCESSABLE_ENTITY, field, message)


def admit(
    reads: Session,
    writes: Session,
    user: User,
    spec: JobSpec,
    settings: Settings,
    idempotency_key: str | None = None,
    trial_of: TrialOf | None = None,
) -> Job:
    """The queued job for `spec`, or Refused. The checks read (files too) in `reads`, which takes no
    write lock on SQLite; only the insert runs in `writes`. The quota is counted in the transaction
    that inserts the job, so two submits at once can't both take the last place; a retry with the
    same idempotency key returns the job it created. A sweep's trial is admitted here too (`trial_of`)."""
    team = check_spec(reads, user, spec, settings)
    spec = spec.model_copy(update={"team": team.name if team else None})  # stored as run: a clone keeps its team
    hand_back_connection(reads, writes)
    try:
        return create_job(
            writes, user, spec, idempotency_key, max_active=settings.max_active_jobs_per_user, trial_of=trial_of, team_id=team.id if team else None
        )
    except KeyReused as exc:
        raise Refused(HTTPStatus.UNPROCESSABLE_ENTITY, None, str(exc)) from exc
    except QuotaExceeded as exc:
        raise Refused(
            HTTPStatus.TOO_MANY_REQUESTS, None, str(exc), QUOTA_RETRY_AFTER_SECONDS, {"limit": exc.limit, "active": exc.active}
        ) from exc


def admit_sweep(reads: Session, writes: Session, user: User, spec: SweepSpec, settings: Settings) -> Sweep:
    """The running sweep for `spec`, or Refused naming the field: its base spec is admitted as a
    job's would be, and each search space path must name a field of it that takes the dimension's
    values (each choice, a range's ends)."""
    try:
        check_spec(reads, user, spec.base, settings)
    except Refused as exc:
        raise Refused(exc.status, ("base", *exc.field) if exc.field else None, exc.message) from exc
    hand_back_connection(reads, writes)
    base = spec.base.model_dump(mode="json")
    for path, dimension in spec.search_space.items():
        for value in dimension.extremes:
            try:
                JobSpec.model_validate(with_params(base, {path: value}))
            except NoSuchField as exc:
                raise bad_field(("search_space", path), "names no field of the job spec") from exc
            except ValidationError as exc:
                error = exc.errors()[0]
                raise bad_field(("search_space", path), f"{value!r}: {'.'.join(map(str, error['loc']))}: {error['msg']}") from exc
    return create_sweep(writes, user, spec)


def hand_back_connection(reads: Session, writes: Session) -> None:
    """End the checks' read transaction before the insert takes a connection of its own: reads and
    writes share one pool, and a burst of submits each holding one connection while waiting for a
    second is a deadlock (until the pool's timeout, then 500s) once the pool is taken. One session
    for both (the sweep controller's) keeps its transaction, and the locks it holds."""
    if reads is not writes:
        reads.commit()


def _team(session: Session, user: User, spec: JobSpec) -> Team | None:
    try:
        return team_for_job(session, user, spec.team)
    except TeamError as exc:
        raise bad_field(("team",), str(exc)) from exc


def check_spec(session: Session, user: User, spec: JobSpec, settings: Settings) -> Team | None:
    """Refused unless `user` may run `spec`: all of admission but the quota; the team it runs under."""
    installed = _check_environment(user, spec) if spec.environment is not None else set()
    if spec.script is not None:
        _check_script(session, user, spec.script, settings, installed)
    else:
        _check_data(session, user, spec, settings)
    team = _team(session, user, spec)
    if spec.resources.pool is not None:
        _check_pool(session, spec.resources)
    elif reason := never_fits(spec.resources, all_hosts(session)):
        raise bad_field(("resources",), reason)
    return team


def _check_pool(session: Session, resources: ResourcesConfig) -> None:
    """The pool exists and one of its nodes could ever run a node of the job (its cluster decides when)."""
    pool = pool_named(session, resources.pool)
    if pool is None:
        names = ", ".join(p.name for p in all_pools(session)) or "none"
        raise bad_field(("resources", "pool"), f"no pool named {resources.pool!r} (pools: {names}; a Slurm pool is listed once "
                        "the scheduler has described its partition: its log says why not)")
    info = pool.info
    if resources.nodes > info["nodes"]:
        raise bad_field(("resources", "nodes"), f"{resources.nodes} nodes: pool {pool.name!r} (partition {info['partition']}) has {info['nodes']}")
    per_node = info["gpus_per_node"] if resources.device == "cuda" else info["cpus_per_node"]
    if resources.processes_per_node > per_node:
        what = "GPUs" if resources.device == "cuda" else "CPUs"
        raise bad_field(("resources", "processes_per_node"), f"{resources.processes_per_node} process{'es' if resources.processes_per_node != 1 else ''}: a node of pool {pool.name!r} has {per_node} {what}")
    # Slurm would keep it pending for ever (PartitionTimeLimit). Without a limit of its own, a job runs
    # there as long as the partition lets it (the Slurm backend asks for no more).
    if resources.max_runtime_hours is not None and info.get("max_minutes") is not None and resources.max_runtime_hours * 60 > info["max_minutes"]:
        raise bad_field(("resources", "max_runtime_hours"), f"{resources.max_runtime_hours:g} hours: pool {pool.name!r} (partition "
                        f"{info['partition']}) runs a job at most {info['max_minutes'] / 60:g} hours")
    # Slurm would refuse it at sbatch, after the job was accepted ("Memory specification can not be satisfied").
    if resources.memory_gb is not None and info.get("memory_mb") and resources.memory_gb * 1024 > info["memory_mb"]:
        raise bad_field(("resources", "memory_gb"), f"{resources.memory_gb:g} GB: a node of pool {pool.name!r} has {info['memory_mb'] / 1024:.3g} GB")


def _check_data(session: Session, user: User, spec: JobSpec, settings: Settings) -> None:
    """What the spec names exists (an upload only if it is the user's), and the data fits the model."""
    if spec.dataset is not None and spec.dataset.upload_id is not None:
        if upload_visible_to(session, user, spec.dataset.upload_id, DATASET) is None:
            raise bad_field(("dataset", "upload_id"), f"no uploaded dataset {spec.dataset.upload_id} of yours")
    try:
        check_spec_paths(spec, settings.resolved_data_root, settings.resolved_plugin_dir)
    except DatasetError as exc:
        raise bad_field(exc.field, str(exc)) from exc


def _check_environment(user: User, spec: JobSpec) -> set[str]:
    """The user may run code (a package is code: a wheel's .pth file runs in every process of the
    job, whatever its kind), and each requirement is one; the names of the packages it installs."""
    if not user.can_run_code:
        raise Refused(
            HTTPStatus.FORBIDDEN,
            None,
            "environment.pip installs packages, which run as code on worker hosts, and needs the can_run_code permission; "
            "an admin grants it with `trainyard user set NAME --can-run-code`",
        )
    names = set()
    for i, requirement in enumerate(spec.environment.pip):
        try:
            names.add(package_name(requirement))
        except InvalidRequirement as exc:  # the schema's pattern lets through some that aren't PEP 508 (`six==!`)
            raise bad_field(("environment", "pip", str(i)), f"not a requirement: {exc}") from exc
    return names


def _check_script(session: Session, user: User, script: ScriptConfig, settings: Settings, installed: set[str]) -> None:
    """The user may run code, the code and its entrypoint exist (a bundle only if it is theirs), and
    the workers provide what it requires, or the job's environment installs it (`installed`)."""
    if not user.can_run_code:
        raise Refused(
            HTTPStatus.FORBIDDEN,
            None,
            "script jobs run your own code on worker hosts and need the can_run_code permission; "
            "an admin grants it with `trainyard user set NAME --can-run-code`",
        )
    named_by = "path" if script.code.path is not None else "upload_id"
    if script.code.upload_id is not None and upload_visible_to(session, user, script.code.upload_id, CODE) is None:
        raise bad_field(("script", "code", "upload_id"), f"no code bundle {script.code.upload_id} of yours")
    try:
        directory = code_directory(settings, script.code)
    except UploadRefused as exc:
        raise bad_field(("script", "code", named_by), str(exc)) from exc
    entrypoint = (directory / script.entrypoint).resolve()
    if not entrypoint.is_relative_to(directory) or not entrypoint.is_file():
        raise bad_field(("script", "entrypoint"), f"no file {script.entrypoint!r} in the code")
    provided = {package_name(name) for name in settings.script_packages} | installed
    for i, requirement in enumerate(script.requirements):
        field = ("script", "requirements", str(i))
        try:
            name = package_name(requirement)
        except InvalidRequirement as exc:  # the schema's pattern lets through some that aren't PEP 508 (`torch==!`)
            raise bad_field(field, f"not a requirement: {exc}") from exc
        if name not in provided:
            raise bad_field(
                field, f"the workers provide no {name!r} and environment.pip does not name it; they provide: {', '.join(sorted(provided - installed))}"
            )
