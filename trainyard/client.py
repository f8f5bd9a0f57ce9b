"""Python client of the Trainyard REST API (sync, httpx), typed with the api_schemas models.

    with Client() as client:             # server and token from args, env, the config file, or `trainyard up`'s token file
        job = client.submit(spec)
        for event in client.events(job.id):  # or job = client.wait(job.id)
            print(event.type, event.data)
        client.download(client.checkpoints(job.id)[-1].id, Path("model.safetensors"))

Every failure, from an HTTP error to a refused connection, is raised as `TrainyardError` with a
message meant for people, so callers print it instead of a traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import yaml
from pydantic import BaseModel, TypeAdapter

from api_schemas import (
    AuditEntryOut, AuditPage, CheckpointOut, DashboardOut, JobEventOut, JobOut, JobPage, JobSpec, JobStatus, LogLineOut, LoginCodeOut, LogsOut,
    MetricsOut, OutputOut, SweepOut, SweepPage, SweepSpec, TeamOut, TokenOut, UploadOut, UsageOut, WorkerOut, field_location,
)
from api_schemas.jobs import relative_inside_root
from api_schemas.manifest import CorruptCheckpoint, verify_manifest
from api_schemas.run_record import RunRecord

DEFAULT_SERVER = "http://127.0.0.1:8000"
SHA256_HEADER = "X-Checkpoint-SHA256"

Model = TypeVar("Model")


class TrainyardError(Exception):
    """A failed call, with a readable message; `status_code` is the HTTP status when there was a response."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


def token_file() -> Path:
    """Where `trainyard up` (embedded mode) wrote the admin token: in $TRAINYARD_DATA_DIR, else in
    the nearest `.trainyard/` going up from the working directory (as git finds `.git`), so the CLI
    finds it from any folder below the one `up` ran in."""
    if data_dir := os.environ.get("TRAINYARD_DATA_DIR"):
        return Path(data_dir) / "token"
    here = Path.cwd()
    for folder in (here, *here.parents):
        if (folder / ".trainyard" / "token").is_file():
            return folder / ".trainyard" / "token"
    return Path(".trainyard") / "token"


def config_file() -> Path:
    """The client's config file: $TRAINYARD_CONFIG, else ~/.config/trainyard/config.yaml."""
    return Path(os.environ.get("TRAINYARD_CONFIG") or Path.home() / ".config" / "trainyard" / "config.yaml")


def read_config() -> dict[str, str]:
    """`server` and `token` from the config file (YAML: `server: https://…` and `token: ty_…`); none without one."""
    path = config_file()
    try:
        config = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise TrainyardError(f"cannot read the config file {path}: {exc}") from None
    if config is None:
        return {}
    if not isinstance(config, dict) or set(config) - {"server", "token"}:
        raise TrainyardError(f"config file {path}: expected only `server:` and `token:` keys")
    return {key: str(value) for key, value in config.items()}


def _server_from_file() -> str | None:
    """Where the `trainyard up` whose token the CLI finds listens (it writes `server` beside `token`)."""
    try:
        return (token_file().parent / "server").read_text().strip() or None
    except OSError:
        return None


def _token_from_file() -> str | None:
    try:
        return token_file().read_text().strip() or None
    except UnicodeDecodeError:
        raise TrainyardError(f"the token file {token_file()} is not text: `trainyard up` writes a new one") from None
    except OSError:
        return None


def _usable_token(where: str, token: str) -> str:
    """The token, without the spaces and line ends a paste brings; a clear error for what no token
    holds (a typographic character pasted from a page), which HTTP headers can't carry."""
    token = token.strip()
    if (odd := next((c for c in token if not c.isascii() or not c.isprintable() or c == " "), None)) is not None:
        raise TrainyardError(f"the token from the {where} holds {odd!r}, which no token has: tokens are letters, digits, - and _ (ty_…)")
    return token


# Not sent in a code bundle: version control, caches and virtual environments.
BUNDLE_SKIPPED = {"__pycache__", ".git", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache"}


def bundle_code(source: Path, left_out: list[str] | None = None) -> bytes:
    """A tar.gz of a directory (without BUNDLE_SKIPPED or hidden entries), or of one file; paths
    inside it are relative to the directory (or are the file's name). A link to a file is sent as
    the file it names (a data file linked in beside the script: the job found nothing there). What
    else is not sent is added to `left_out`: hidden entries (each left-out tree once) and links to
    directories."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", dereference=True) as tar:
        if source.is_file():
            tar.add(source, arcname=source.name)
        else:
            for path in sorted(source.rglob("*")):
                relative = path.relative_to(source)
                skipped = next((i for i, part in enumerate(relative.parts) if part in BUNDLE_SKIPPED or part.startswith(".")), None)
                if skipped is not None:
                    top = PurePosixPath(*relative.parts[: skipped + 1]).as_posix()
                    if left_out is not None and relative.parts[skipped] not in BUNDLE_SKIPPED and top not in left_out:
                        left_out.append(top)  # a hidden file or folder (what BUNDLE_SKIPPED names goes unsaid)
                elif path.is_file():  # a link to a file too (not to a directory: its files come by their own paths)
                    tar.add(path, arcname=relative.as_posix())
                elif path.is_symlink() and left_out is not None:  # a link to a directory, or to nothing
                    left_out.append(f"{relative.as_posix()} (a link to {'a directory' if path.is_dir() else 'nothing'})")
    return out.getvalue()


def error_message(response: httpx.Response, token_source: str | None = None) -> str:
    """The server's reason for an error response; FastAPI's 422 list becomes one `loc: msg` line per problem."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):  # not JSON, or JSON that isn't an object
        detail = response.text.strip()[:500] or None
    status = f"HTTP {response.status_code}"
    if isinstance(detail, list):
        problems = "\n".join(f"  {_validation_problem(error)}" for error in detail)
        return f"the server rejected the request ({status}):\n{problems}"
    if isinstance(detail, dict):  # a structured detail (the 429 quota answer) carries its sentence in `msg`
        detail = detail.get("msg")
    reason = detail if isinstance(detail, str) and detail else response.reason_phrase
    if response.status_code == 401:  # where the token came from, to fix it there (see Client.__init__)
        reason += {
            "argument": "; check --token",
            "environment": "; check TRAINYARD_TOKEN",
            "config": f"; check the token in {config_file()}",
        }.get(token_source, f"; pass --token or set TRAINYARD_TOKEN (`trainyard up` writes its admin's to {token_file()})")
    return f"{reason} ({status})"


def _validation_problem(error: Any) -> str:
    if not isinstance(error, dict):
        return str(error)
    loc = list(field_location(error.get("loc") or []))
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]  # where in the request is implied by the call
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    message = str(error.get("msg", error)).removeprefix("Value error, ")  # pydantic's prefix for our own checks
    if not where or message.startswith((f"{where}:", f"{where}.", f"{where} ")):
        return message  # a section's own check names the field already ("resources.elastic: one node only")
    return f"{where}: {message}"


class Client:
    def __init__(self, server: str | None = None, token: str | None = None, timeout: float = 30.0):
        # Each from the first place that has it: argument, environment, config file, then defaults.
        config = {} if server and token else read_config()
        # The server's base address; one given with the API's `/v1` (as the API reference writes its
        # routes) is taken as meant, not answered "Not Found" on every command.
        given = server or os.environ.get("TRAINYARD_SERVER") or config.get("server") or _server_from_file()
        self.server = (given or DEFAULT_SERVER).rstrip("/").removesuffix("/v1")
        self.server_is_default = not given  # an unreachable default is worth a word on where the address comes from
        found = [("argument", token), ("environment", os.environ.get("TRAINYARD_TOKEN")), ("config", config.get("token")), ("file", _token_from_file())]
        self.token_source, self.token = next(((where, value) for where, value in found if value and value.strip()), (None, None))  # where: for `token rotate`
        if self.token is not None:
            where = {"argument": "--token argument", "environment": "environment (TRAINYARD_TOKEN)", "config": "config file"}
            self.token = _usable_token(where.get(self.token_source, f"token file {token_file()}"), self.token)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- jobs --------------------------------------------------------------------------------------

    def submit(self, spec: JobSpec | dict, idempotency_key: str | None = None) -> JobOut:
        """Submit a job. A dict is sent as is, so the server's validation (and its 422 reasons) applies."""
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else spec
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call(JobOut, "POST", "/v1/jobs", json=body, headers=headers)

    def jobs(self, status: JobStatus | str | None = None, limit: int = 50) -> Iterator[JobOut]:
        """All visible jobs, newest first, fetched `limit` per request as the iteration goes."""
        params: dict[str, Any] = {"limit": limit}
        if status is not None:
            params["status"] = JobStatus(status).value
        return self._pages(JobPage, "/v1/jobs", params)

    def job(self, job_id: int) -> JobOut:
        return self._call(JobOut, "GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: int) -> JobOut:
        return self._call(JobOut, "POST", f"/v1/jobs/{job_id}/cancel")

    # -- sweeps ------------------------------------------------------------------------------------

    def submit_sweep(self, spec: SweepSpec | dict) -> SweepOut:
        """Start a hyperparameter search; its trials are jobs the server submits (see api_schemas/sweeps.py)."""
        body = spec.model_dump(mode="json") if isinstance(spec, SweepSpec) else spec
        return self._call(SweepOut, "POST", "/v1/sweeps", json=body)

    def sweeps(self, limit: int = 50) -> Iterator[SweepOut]:
        """All visible sweeps, newest first, fetched `limit` per request as the iteration goes."""
        return self._pages(SweepPage, "/v1/sweeps", {"limit": limit})

    def sweep(self, sweep_id: int) -> SweepOut:
        """The sweep with its trials, its best trial, and that trial's spec (`best_spec`), ready to submit."""
        return self._call(SweepOut, "GET", f"/v1/sweeps/{sweep_id}")

    def cancel_sweep(self, sweep_id: int) -> SweepOut:
        return self._call(SweepOut, "POST", f"/v1/sweeps/{sweep_id}/cancel")

    def wait(self, job_id: int, poll: float = 1.0, on_update: Callable[[JobOut], None] | None = None) -> JobOut:
        """Poll the job until it reaches a final status; `on_update` sees every poll's state."""
        while True:
            job = self.job(job_id)
            if on_update is not None:
                on_update(job)
            if job.status.is_final:
                return job
            time.sleep(poll)

    def events(self, job_id: int, last_event_id: int | None = None, retries: int = 5, retry_seconds: float = 1.0) -> Iterator[JobEventOut]:
        """The job's events (status changes, metrics per step, checkpoints) as they happen, until it is final.

        A dropped connection is resumed with Last-Event-ID, so no event is missed or repeated; give
        up after `retries` failures in a row. `last_event_id` starts after an event seen earlier.
        """
        for data in self._follow(f"/v1/jobs/{job_id}/events", {}, last_event_id, retries, retry_seconds):
            yield JobEventOut.model_validate_json(data)

    def metrics(
        self, job_id: int, names: Sequence[str] | None = None, from_step: int | None = None, max_points: int | None = None
    ) -> MetricsOut:
        params = {"names": ",".join(names) if names else None, "from_step": from_step, "max_points": max_points}
        return self._call(MetricsOut, "GET", f"/v1/jobs/{job_id}/metrics", params=_without_none(params))

    def logs(self, job_id: int, tail: int = 100, cursor: str | None = None, rank: int | None = None) -> LogsOut:
        """The last `tail` lines; with `cursor` (a previous read's `next_cursor`), up to `tail` lines
        after it; with `rank`, only that process's."""
        params = _without_none({"tail": tail, "cursor": cursor, "rank": rank})
        return self._call(LogsOut, "GET", f"/v1/jobs/{job_id}/logs", params=params)

    def follow_logs(
        self, job_id: int, tail: int = 100, rank: int | None = None, retries: int = 5, retry_seconds: float = 1.0
    ) -> Iterator[LogLineOut]:
        """The last `tail` lines, then every new line as it is stored, until the job has ended; a
        dropped connection is resumed after the last line received, as `events` does."""
        params = _without_none({"follow": "true", "tail": tail, "rank": rank})
        for data in self._follow(f"/v1/jobs/{job_id}/logs", params, None, retries, retry_seconds):
            yield LogLineOut.model_validate_json(data)

    def _follow(self, path: str, params: dict, last_id: int | None, retries: int, retry_seconds: float) -> Iterator[str]:
        """The data of each message of one of the server's polled event streams (service/api/events.py)
        until its `end`; a cut stream is reopened with Last-Event-ID, up to `retries` times in a row."""
        failures = 0
        while True:
            headers = {"Last-Event-ID": str(last_id)} if last_id is not None else {}
            try:
                with self._stream("GET", path, params=params, headers=headers) as response:
                    for message in sse_messages(response.iter_lines()):
                        if message.get("event") == "end":
                            return
                        last_id, failures = int(message["id"]), 0
                        yield message["data"]
                error = TrainyardError(f"the stream {path} ended before the job did")
            except TrainyardError as exc:
                if exc.status_code is not None:
                    raise  # the server answered with an error (404, 401): asking again would only repeat it
                error = exc
            failures += 1
            if failures > retries:
                raise error
            time.sleep(retry_seconds)

    def record(self, job_id: int) -> RunRecord:
        """The job's run record: its spec and what each attempt ran with (api_schemas/run_record.py)."""
        return self._call(RunRecord, "GET", f"/v1/jobs/{job_id}/record")

    def checkpoints(self, job_id: int) -> list[CheckpointOut]:
        return self._call(list[CheckpointOut], "GET", f"/v1/jobs/{job_id}/checkpoints")

    def outputs(self, job_id: int) -> list[OutputOut]:
        """The directories a script job wrote (`script.outputs`), as last collected."""
        return self._call(list[OutputOut], "GET", f"/v1/jobs/{job_id}/outputs")

    # -- uploads -----------------------------------------------------------------------------------

    def upload_dataset(self, path: Path, name: str | None = None) -> UploadOut:
        """Upload a data file (streamed from disk); a job then names it as `"dataset": {…, "upload_id": ID}`."""
        path = Path(path)
        try:
            body = open(path, "rb")
        except OSError as exc:
            raise TrainyardError(f"cannot read {path}: {exc.strerror}") from None
        with body:
            return self._upload("/v1/datasets", body, name or path.name)

    def datasets(self) -> list[UploadOut]:
        return self._call(list[UploadOut], "GET", "/v1/datasets")

    def upload_code(self, source: Path, name: str | None = None, left_out: list[str] | None = None) -> UploadOut:
        """Upload a code bundle: a directory or a single file, sent as a tar.gz (see `bundle_code`,
        which lists in `left_out` what it did not send)."""
        source = Path(source)
        return self._upload("/v1/code", io.BytesIO(bundle_code(source, left_out)), name or f"{source.resolve().name}.tar.gz")

    def code_bundles(self) -> list[UploadOut]:
        return self._call(list[UploadOut], "GET", "/v1/code")

    def submit_script(
        self, script: Path, args: Sequence[str] = (), *, code_dir: Path | None = None, left_out: list[str] | None = None, **spec: Any
    ) -> JobOut:
        """Bundle `code_dir` (default: just the script), upload it and submit a `script` job running
        `script` (a path inside `code_dir`) with `args`. `spec` adds job spec sections, e.g.
        `resources={"processes_per_node": 2}`, and `script_<field>` fields of the `script` section:
        `script_resume_args=[…]`, `script_outputs=["out"]`."""
        script = Path(script).resolve()
        root = Path(code_dir).resolve() if code_dir is not None else script.parent
        bundle = self.upload_code(root if code_dir is not None else script, left_out=left_out)
        entrypoint = script.relative_to(root).as_posix()
        script_fields = {key.removeprefix("script_"): spec.pop(key) for key in list(spec) if key.startswith("script_")}
        name = re.sub(r"[^A-Za-z0-9._-]", "-", script.stem).lstrip("._-") or "script"
        body = {
            "name": spec.pop("name", name),
            "script": {"entrypoint": entrypoint, "args": list(args), "code": {"upload_id": bundle.id}, **script_fields},
            **spec,
        }
        return self.submit(body)

    def _upload(self, route: str, body, name: str) -> UploadOut:
        headers = {"Content-Type": "application/octet-stream"}
        return self._call(UploadOut, "POST", route, params={"name": name}, content=body, headers=headers)

    # -- account -----------------------------------------------------------------------------------

    def rotate_token(self) -> TokenOut:
        """A new token for this client's user; the current one stops working, and this client uses the new one."""
        new = self._call(TokenOut, "POST", "/v1/token/rotate")
        self.token = new.token
        self._http.headers["Authorization"] = f"Bearer {new.token}"
        return new

    def login_link(self) -> tuple[str, datetime]:
        """A link that signs a browser in as this client's user, once, and when it stops working
        (the browser gets a session of its own; the token is never in the link)."""
        code = self._call(LoginCodeOut, "POST", "/v1/login-codes")
        return self.server + code.link, code.expires_at

    def usage(self, since: datetime | None = None, limit: int = 20) -> UsageOut:
        """Device-seconds per user and job: your own, or everyone's for an admin."""
        return self._call(UsageOut, "GET", "/v1/usage", params=_without_none({"since": since and since.isoformat(), "limit": limit}))

    def audit(self, user: str | None = None, since: datetime | None = None, limit: int = 50) -> Iterator[AuditEntryOut]:
        """The audit trail, newest first (admins only)."""
        params = _without_none({"user": user, "since": since and since.isoformat(), "limit": min(limit, 200)})
        return itertools.islice(self._pages(AuditPage, "/v1/audit", params), limit)

    # -- teams -------------------------------------------------------------------------------------

    def teams(self) -> list[TeamOut]:
        """Every team: quota, members, what it holds and borrows now, its fair share."""
        return self._call(list[TeamOut], "GET", "/v1/teams")

    def create_team(self, name: str, quota: dict[str, int]) -> TeamOut:
        """A new team with a nominal quota of process slots per device kind ({"cuda": 8}); admins only."""
        return self._call(TeamOut, "POST", "/v1/teams", json={"name": name, "quota": quota})

    def set_team_quota(self, name: str, quota: dict[str, int]) -> TeamOut:
        return self._call(TeamOut, "PUT", f"/v1/teams/{name}/quota", json={"quota": quota})

    def add_team_member(self, name: str, user: str, default: bool = False) -> TeamOut:
        return self._call(TeamOut, "POST", f"/v1/teams/{name}/members", json={"user": user, "default": default})

    def remove_team_member(self, name: str, user: str) -> TeamOut:
        return self._call(TeamOut, "DELETE", f"/v1/teams/{name}/members/{user}")

    def delete_team(self, name: str) -> None:
        """Only a team no job ever ran under (409 otherwise: set its quota to 0 instead)."""
        with self._stream("DELETE", f"/v1/teams/{name}") as response:
            response.read()

    # -- cluster -----------------------------------------------------------------------------------

    def dashboard(self) -> DashboardOut:
        return self._call(DashboardOut, "GET", "/v1/dashboard")

    def workers(self) -> list[WorkerOut]:
        return self._call(list[WorkerOut], "GET", "/v1/workers")

    def health(self) -> bool:
        return self._call(dict, "GET", "/healthz").get("status") == "ok"

    # -- checkpoint download -----------------------------------------------------------------------

    def download(self, checkpoint_id: int, dest: Path, progress: Callable[[int, int | None], None] | None = None) -> Path:
        """Download a checkpoint's model.safetensors to `dest`, verified against the server's sha256.

        Bytes go to `dest.part` first; a `.part` left by an interrupted download is resumed with
        a Range request. Only a complete, verified file is renamed to `dest`. `progress(done, total)`
        is called as bytes arrive (total is None when the server doesn't say). A directory `dest`
        gets `checkpoint-N.safetensors` inside; a device, pipe or socket is refused (the finished file
        is renamed over `dest`: `-o /dev/null` replaced the machine's /dev/null).
        """
        dest = Path(dest)
        if dest.is_dir():
            dest = dest / f"checkpoint-{checkpoint_id}.safetensors"
        elif dest.exists() and not dest.is_file():
            raise TrainyardError(f"{dest} is not a regular file (a device, a pipe or a socket), which the download would replace: give a file's path")
        partial = dest.with_name(dest.name + ".part")
        dest.parent.mkdir(parents=True, exist_ok=True)
        offset = partial.stat().st_size if partial.exists() else 0
        url = f"/v1/checkpoints/{checkpoint_id}/download"
        try:
            with self._stream("GET", url, headers={"Range": f"bytes={offset}-"} if offset else {}) as response:
                expected = response.headers.get(SHA256_HEADER)
                if response.headers.get("content-type") == "application/x-tar":
                    raise TrainyardError(
                        f"checkpoint {checkpoint_id} holds no model.safetensors (a script's checkpoint): "
                        f"download its whole state with `trainyard download {checkpoint_id} --state`"
                    )
                if not expected:
                    raise TrainyardError(f"checkpoint {checkpoint_id}: the server sent no {SHA256_HEADER} header to verify against")
                actual = _save_body(response, partial, progress)
        except TrainyardError as exc:
            if exc.status_code == 416 and offset:
                # The .part is as long as the file or longer: it can't be resumed, so start over.
                partial.unlink()
                return self.download(checkpoint_id, dest, progress)
            if exc.status_code is None and partial.exists():
                raise TrainyardError(f"{exc}; the partial download {partial} is kept: run the download again to resume") from exc
            raise

        if actual != expected.lower():
            partial.unlink()  # resuming a corrupt file would only reproduce the mismatch
            raise TrainyardError(
                f"checkpoint {checkpoint_id}: sha256 mismatch, the download is corrupt and was deleted "
                f"(expected {expected}, got {actual})"
            )
        partial.replace(dest)
        return dest

    def download_state(self, checkpoint_id: int, dest: Path) -> Path:
        """The checkpoint's whole directory (Accelerate state, weights, spec, manifest) unpacked
        under `dest`, verified against its manifest; returns that directory. What a run resumes from.
        An existing directory of that name is left alone (an error), as `download_output` leaves one:
        unpacked over, it kept files of another download beside this one's."""
        dest = Path(dest)
        if dest.exists() and not dest.is_dir():
            raise TrainyardError(f"{dest} is not a directory: the download unpacks a folder into one")
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest, prefix=".trainyard-") as unpacking:
            top = self._download_tree(f"/v1/checkpoints/{checkpoint_id}/download", {"format": "tar"}, Path(unpacking), f"checkpoint {checkpoint_id}")
            if (target := dest / top.name).exists():
                raise TrainyardError(f"{target} exists already; remove it or unpack somewhere else")
            os.rename(top, target)
        return target

    def download_output(self, job_id: int, name: str, dest: Path) -> Path:
        """A script job's output directory unpacked as `dest/<name>`, every file verified against
        its manifest; returns that directory. An existing `dest/<name>` is left alone (an error)."""
        if Path(dest).exists() and not Path(dest).is_dir():
            raise TrainyardError(f"{dest} is not a directory: outputs are unpacked into one")
        target = Path(dest) / relative_inside_root(name, "the destination")  # the name comes from the server
        if target.exists():
            raise TrainyardError(f"{target} exists already; remove it or unpack somewhere else")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".trainyard-") as unpacking:
            top = self._download_tree(f"/v1/jobs/{job_id}/outputs/{quote(name)}", {}, Path(unpacking), f"job {job_id}'s output {name}")
            # An output of no files (its folders were all checkpoints, taken in as such) is a manifest alone.
            (top / name).mkdir(parents=True, exist_ok=True)
            os.rename(top / name, target)
        return target

    def _download_tree(self, path: str, params: dict[str, str], dest: Path, what: str) -> Path:
        """A tar download unpacked under `dest`: its one top directory, verified against the manifest in it."""
        if dest.exists() and not dest.is_dir():
            raise TrainyardError(f"{dest} is not a directory: the download unpacks a folder into one")
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as archive:
            with self._stream("GET", path, params=params) as response:
                for chunk in response.iter_bytes(1 << 20):
                    archive.write(chunk)
            archive.seek(0)
            with tarfile.open(fileobj=archive) as tar:
                [top] = {member.name.split("/")[0] for member in tar.getmembers()}
                tar.extractall(dest, filter="data")  # no absolute paths, '..' or links out
        try:
            verify_manifest(dest / top)
        except CorruptCheckpoint as exc:
            shutil.rmtree(dest / top, ignore_errors=True)
            raise TrainyardError(f"{what}: the download is corrupt and was deleted ({exc})") from exc
        return dest / top

    # -- plumbing ----------------------------------------------------------------------------------

    def _pages(self, page_model: type[JobPage] | type[SweepPage] | type[AuditPage], path: str, params: dict[str, Any]) -> Iterator:
        """Every item of a cursor-paginated list, a page per request as the iteration goes."""
        while True:
            page = self._call(page_model, "GET", path, params=params)
            yield from page.items
            if page.next_cursor is None:
                return
            params = {**params, "cursor": page.next_cursor}

    def _call(self, model: type[Model], method: str, path: str, **kwargs) -> Model:
        """One request; the JSON response parsed into `model` (a pydantic model, or a type like list[X])."""
        with self._stream(method, path, **kwargs) as response:
            response.read()
        if isinstance(model, type) and issubclass(model, BaseModel):
            return model.model_validate(response.json())
        return TypeAdapter(model).validate_python(response.json())

    @contextlib.contextmanager
    def _stream(self, method: str, path: str, **kwargs) -> Iterator[httpx.Response]:
        """A streamed response with a success status; anything else is raised as TrainyardError."""
        try:
            with self._http.stream(method, path, **kwargs) as response:
                if response.is_error:
                    response.read()
                    raise TrainyardError(error_message(response, self.token_source), status_code=response.status_code)
                yield response
        except httpx.ConnectError as exc:
            if self.server.startswith("https://") and "SSL" in str(exc):  # something answered, not in TLS
                raise TrainyardError(f"Trainyard at {self.server} does not answer in HTTPS ({exc}): is its address http://?") from exc
            where = (" (the default: no `.trainyard/` here or above, where `trainyard up` notes its address; run this under the folder "
                     "it ran in, or pass --server)") if self.server_is_default else ""
            raise TrainyardError(f"cannot reach Trainyard at {self.server}{where} — is `trainyard up` running?") from exc
        except httpx.TimeoutException as exc:
            raise TrainyardError(f"Trainyard at {self.server} did not answer in time ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:  # e.g. the connection dropped mid-response
            raise TrainyardError(f"the connection to Trainyard at {self.server} failed: {exc or type(exc).__name__}") from exc
        except ValueError as exc:  # httpx refuses to write NaN or an infinity as JSON
            if "JSON compliant" not in str(exc):
                raise
            raise TrainyardError("the request holds NaN or an infinite number, which JSON can't carry: give finite numbers") from exc


def sse_messages(lines: Iterator[str]) -> Iterator[dict[str, str]]:
    """Server-Sent Events messages as {field: value}; comments (heartbeats) are skipped."""
    message: dict[str, str] = {}
    for line in lines:
        if line.startswith(":"):
            continue
        if line:
            field, _, value = line.partition(":")
            message[field] = value.removeprefix(" ")
        elif message:
            yield message
            message = {}


def _without_none(params: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in params.items() if value is not None}


def _save_body(response: httpx.Response, partial: Path, progress: Callable[[int, int | None], None] | None) -> str:
    """Write the body to `partial`, after its bytes for a 206 (the rest of the file); returns the file's sha256."""
    resumed = response.status_code == 206  # otherwise the server sent the whole file
    digest = hashlib.sha256()
    done = _hash_file(partial, digest) if resumed else 0
    total = done + int(response.headers["Content-Length"]) if "Content-Length" in response.headers else None
    with open(partial, "ab" if resumed else "wb") as out:
        for chunk in response.iter_bytes():  # as received: a buffered chunk would be lost if the connection drops
            out.write(chunk)
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return digest.hexdigest()


def _hash_file(path: Path, digest: Any) -> int:
    """Feed the file into `digest`; returns its size."""
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return size
