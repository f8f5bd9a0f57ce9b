"""Files to and from hosts that don't share the artifact store's filesystem (api_schemas/host_api.py):
a checkpoint or a script's output arrives file by file, each resumable from where a cut left it,
and is verified against its manifest (every byte hashed here) before it is moved into the store;
an attempt reads the checkpoint it resumes from, a script's code and the data inputs its spec names
(JobSpec.data_paths: dataset, tokenizer, model directory) file by file, with Range.

No transaction is open while a body arrives or a file is sent: the host is authenticated and the
attempt found to be its own first, each in a short read of its own. What a host may touch is its
own attempts' uploads and its own job's resume checkpoint and code, as for every host route.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path, PurePosixPath
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path as PathParam, Query, Request, status
from fastapi.responses import FileResponse
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from api_schemas.host_api import (
    FILE_KINDS, HOST_API_PREFIX, UPLOAD_ID_PATTERN, CheckpointSeal, DirectoryListing, ListedFile, OutputSeal, StoredItem, Transferred, inside_path,
)
from api_schemas.jobs import CodeSource, JobSpec
from api_schemas.manifest import MANIFEST_FILE, CorruptCheckpoint, read_manifest, sha256_file
from service.api.deps import MAY_BE_MISSING, NEEDS_TOKEN, CurrentHost, RowId, SettingsDep, StoreDep, not_found
from common.artifacts import ArtifactStore
from service.datasets import DatasetError, resolve_under_root
from service.db.attempts import HeldAttempt, attempt_on_host
from service.db.models import Attempt, Checkpoint, Job
from service.db.session import read_session_factory
from common.settings import Settings
from service.uploads import UploadRefused, code_directory

router = APIRouter(prefix=HOST_API_PREFIX, tags=["worker protocol"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING})

UploadKey = Annotated[str, PathParam(pattern=UPLOAD_ID_PATTERN, description="The host's name for one item's upload (a uuid4's hex).")]
FileKind = Annotated[str, PathParam(pattern=f"^({'|'.join(FILE_KINDS)})$")]


def _own(settings: Settings, host: str, attempt_id: int) -> HeldAttempt:
    with read_session_factory(settings.resolved_database_url)() as session:
        held = attempt_on_host(session, attempt_id, host, lease_owner="")
    if held is None:
        raise not_found("attempt")
    return held


def _relative(path: str) -> PurePosixPath:
    """A file's path inside an upload or a listed directory (a 422 for one that could name anything outside)."""
    try:
        return PurePosixPath(inside_path(path))
    except ValueError as exc:
        raise HTTPException(422, [{"loc": ["path", "path"], "msg": str(exc), "type": "value_error"}]) from None


# -- uploads --------------------------------------------------------------------------------------

@router.get("/attempts/{attempt_id}/uploads/{upload_id}/{path:path}", response_model=Transferred)
async def upload_progress(attempt_id: RowId, upload_id: UploadKey, path: str, host: CurrentHost, settings: SettingsDep, store: StoreDep) -> Transferred:
    """How many bytes of the file have arrived (0 for one not begun): where the next write starts."""
    held = await run_in_threadpool(_own, settings, host, attempt_id)
    target = store.upload_dir(held.job_id, held.attempt_id, upload_id) / _relative(path)
    return Transferred(received=target.stat().st_size if target.is_file() else 0)


@router.put("/attempts/{attempt_id}/uploads/{upload_id}/{path:path}", response_model=Transferred, responses={
    413: {"description": "The file would be larger than an attempt's directory may hold."},
    416: {"description": "`offset` is past what has arrived: ask how much has (GET)."},
})
async def upload_part(
    request: Request, attempt_id: RowId, upload_id: UploadKey, path: str, host: CurrentHost, settings: SettingsDep, store: StoreDep,
    offset: Annotated[int, Query(ge=0, description="Where in the file this body goes: at most what has arrived.")] = 0,
) -> Transferred:
    """Write the body into the file at `offset`, dropping what was after it (a part sent again after
    a lost answer lands where it did). A body cut short keeps what arrived: the host asks how much
    and goes on from there."""
    held = await run_in_threadpool(_own, settings, host, attempt_id)
    target = store.upload_dir(held.job_id, held.attempt_id, upload_id) / _relative(path)
    received = target.stat().st_size if target.is_file() else 0
    if offset > received:
        raise HTTPException(status.HTTP_416_RANGE_NOT_SATISFIABLE, f"offset {offset} is past the {received} bytes received")
    limit = int(settings.max_attempt_disk_gb * 1e9)
    fd = await run_in_threadpool(_open_at, target, offset)
    try:
        written = offset
        try:
            async for chunk in request.stream():
                written += len(chunk)
                if written > limit:
                    raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"a file of an upload may hold at most {limit} bytes")
                await run_in_threadpool(os.write, fd, chunk)  # a slow disk holds this request, not the event loop's others
        except ClientDisconnect:
            pass  # what arrived is kept; the host asks how much, and sends the rest
    finally:
        os.close(fd)
    return Transferred(received=written)


def _open_at(target: Path, offset: int) -> int:
    """The file opened for writing at `offset`, what was after it dropped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o600)
    os.ftruncate(fd, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return fd


def _sealed(store: ArtifactStore, take, staging: Path, *args) -> StoredItem:
    try:
        path, sha256, size, *files = take(staging, *args)
    except CorruptCheckpoint as exc:
        why = str(exc).replace(str(staging), "the upload")  # the service's own paths are not the host's to know
        raise HTTPException(422, [{"loc": ["body"], "msg": f"the upload does not match its manifest: {why}", "type": "value_error"}]) from None
    return StoredItem(path=path, sha256=sha256, size=size, files=files[0] if files else len(read_manifest(store.path(path))["files"]))


@router.post("/attempts/{attempt_id}/uploads/{upload_id}/checkpoint", response_model=StoredItem, responses={
    422: {"description": "The upload is not a whole checkpoint: a file missing, cut short or changed."},
})
def seal_checkpoint(attempt_id: RowId, upload_id: UploadKey, body: CheckpointSeal, host: CurrentHost, settings: SettingsDep, store: StoreDep) -> StoredItem:
    """The upload is a whole checkpoint: every file hashed against its manifest and, only if all
    match, moved into the job's checkpoints as `folder`. Register it then (POST checkpoints)."""
    held = _own(settings, host, attempt_id)
    staging = store.upload_dir(held.job_id, held.attempt_id, upload_id)
    _safe_manifest(staging)
    return _sealed(store, store.ingest_checkpoint, staging, held.job_id, body.step, body.folder, False)


@router.post("/attempts/{attempt_id}/uploads/{upload_id}/output", response_model=StoredItem, responses={
    422: {"description": "The upload is not a whole output: a file missing, cut short or changed, or more than `name/`."},
})
def seal_output(attempt_id: RowId, upload_id: UploadKey, body: OutputSeal, host: CurrentHost, settings: SettingsDep, store: StoreDep) -> StoredItem:
    """The upload is a script's output `name/…` with its manifest: verified and moved into the job's outputs."""
    held = _own(settings, host, attempt_id)
    staging = store.upload_dir(held.job_id, held.attempt_id, upload_id)
    _safe_manifest(staging)
    return _sealed(store, store.seal_output, staging, held.job_id, upload_id, body.name)


def _safe_manifest(staging: Path) -> None:
    """The host wrote the manifest: before any file it names is read, each must be a path inside the upload."""
    if not (staging / MANIFEST_FILE).is_file():
        return  # a seal sent again finds the upload moved already; one never uploaded fails as corrupt
    try:
        for path in read_manifest(staging)["files"]:
            _relative(path)
    except (CorruptCheckpoint, HTTPException):
        raise HTTPException(422, [{"loc": ["body"], "msg": "the upload's manifest is unreadable or names a path outside it", "type": "value_error"}]) from None


# -- what an attempt reads --------------------------------------------------------------------------

def _data_files(settings: Settings, held: HeldAttempt) -> dict[str, Path]:
    """The files of the data inputs the attempt's job names, by their paths under the data root (a
    directory's each by its own); one missing or resolving outside the root is left out (the
    training fails on it, saying so, as it would on a host that shares the data root)."""
    with read_session_factory(settings.resolved_database_url)() as session:
        spec = JobSpec.from_stored(session.scalar(select(Job.spec).where(Job.id == held.job_id)))
    root, files = settings.resolved_data_root.resolve(), {}
    for relative in spec.data_paths:
        try:
            path = resolve_under_root(root, relative)
        except DatasetError:
            continue
        if path.is_file():
            files[relative] = path
        for inside in sorted(path.rglob("*")) if path.is_dir() else ():
            if inside.is_file() and not inside.is_symlink():
                files[inside.relative_to(root).as_posix()] = inside
    return files


def _data_sha256(path: Path) -> str:
    """A data file's sha256, hashed again only when the file changed: every attempt of every job on
    the data lists it, and a dataset of gigabytes takes seconds to hash (the data root is the
    service's own, so its files' change times can be trusted, unlike an upload's)."""
    status = path.stat()
    return _sha256_of(str(path), status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


@functools.lru_cache(maxsize=4096)
def _sha256_of(path: str, inode: int, size: int, modified_ns: int, changed_ns: int) -> str:
    return sha256_file(Path(path))


def _readable(settings: Settings, store: ArtifactStore, held: HeldAttempt, kind: str) -> Path:
    """The directory of `kind` this attempt may read: the checkpoint it resumes from, or its script's code."""
    with read_session_factory(settings.resolved_database_url)() as session:
        if kind == "resume":
            path = session.scalar(
                select(Checkpoint.path).join(Attempt, Attempt.resume_checkpoint_id == Checkpoint.id).where(Attempt.id == held.attempt_id)
            )
            if path is None:
                raise not_found("checkpoint to resume from")
            return store.path(path)
        script = session.scalar(select(Job.spec).where(Job.id == held.job_id)).get("script")
    if script is None:
        raise not_found("code (not a script job)")
    try:
        return code_directory(settings, CodeSource.model_validate(script["code"]))
    except UploadRefused as exc:
        raise not_found(f"code ({exc})") from None


def _listing(directory: Path, kind: str) -> DirectoryListing:
    if kind == "resume":  # verified when it was stored: its manifest says it, and lists itself too
        files = {path: ListedFile(**entry) for path, entry in read_manifest(directory)["files"].items()}
        manifest = directory / MANIFEST_FILE
        files[MANIFEST_FILE] = ListedFile(size=manifest.stat().st_size, sha256=sha256_file(manifest))
        return DirectoryListing(files=files)
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            files[path.relative_to(directory).as_posix()] = ListedFile(size=path.stat().st_size, sha256=sha256_file(path))
    return DirectoryListing(files=files)


@router.get("/attempts/{attempt_id}/files/{kind}", response_model=DirectoryListing)
def list_files(attempt_id: RowId, kind: FileKind, host: CurrentHost, settings: SettingsDep, store: StoreDep) -> DirectoryListing:
    """The files of the checkpoint this attempt resumes from (`resume`), of its script's code (`code`) or of the data its spec
    names (`data`, by their paths under the data root), each with its size and sha256."""
    held = _own(settings, host, attempt_id)
    if kind == "data":
        return DirectoryListing(files={
            relative: ListedFile(size=path.stat().st_size, sha256=_data_sha256(path)) for relative, path in _data_files(settings, held).items()
        })
    directory = _readable(settings, store, held, kind)
    if not directory.is_dir():
        raise not_found(f"{kind} files")
    return _listing(directory, kind)


@router.get("/attempts/{attempt_id}/files/{kind}/{path:path}", response_model=None)
def read_file(attempt_id: RowId, kind: FileKind, path: str, host: CurrentHost, settings: SettingsDep, store: StoreDep) -> FileResponse:
    """One file of the listing, resumable with Range."""
    held = _own(settings, host, attempt_id)
    if kind == "data":  # only what the listing names: nothing else of the data root
        if (file := _data_files(settings, held).get(path)) is None:
            raise not_found("file")
        return FileResponse(file, media_type="application/octet-stream")
    directory = _readable(settings, store, held, kind)
    file = directory / _relative(path)
    if file.is_symlink() or not file.is_file() or not file.resolve().is_relative_to(directory.resolve()):
        raise not_found("file")
    return FileResponse(file, media_type="application/octet-stream")
