"""Uploads: `POST /v1/datasets` (one data file) and `POST /v1/code` (a tar or zip code bundle).

The body is the file itself (`application/octet-stream`) or a `multipart/form-data` form with a
`file` field, streamed to disk as it arrives either way; `?name=` is the file name to show
(default: the form's file name). Uploads are owned by their user: others get 404.

No transaction is open while the body arrives (at whatever speed the client sends it) or while a
bundle unpacks: the caller is authenticated before, and the upload recorded after, each in a short
transaction of its own. A body cut short (before its Content-Length, or a multipart body before its
closing boundary) is refused with 422 and nothing is stored.
"""

from __future__ import annotations

import re
from typing import Annotated

from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, HTTPException, Query, Request, status
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from api_schemas import UploadOut
from service import uploads
from service.api.audit import note
from service.api.deps import MAY_BE_MISSING, NEEDS_TOKEN, CurrentUser, RowId, SessionDep, SessionsEndWithRoute, SettingsDep, not_found
from service.db.uploads import create_upload, upload_visible_to, uploads_visible_to
from service.db.models import Upload, User
from service.db.session import session_factory
from common.settings import Settings

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_. +-]*$"
UploadName = Annotated[
    str | None,
    Query(
        min_length=1, max_length=200, pattern=NAME_PATTERN,
        description="File name to show (no slashes); default: the multipart form's file name.",
    ),
]
UPLOAD_ERRORS = {
    **NEEDS_TOKEN,
    413: {"description": "Larger than TRAINYARD_MAX_UPLOAD_BYTES."},
    422: {"description": "Empty, cut short, or (code) not a safe tar/zip archive within the unpack limits."},
}
BINARY = {"type": "string", "format": "binary"}
BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {"schema": BINARY},
            "multipart/form-data": {"schema": {"type": "object", "properties": {"file": BINARY}, "required": ["file"]}},
        },
    }
}

datasets = APIRouter(prefix="/v1/datasets", tags=["uploads"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING}, route_class=SessionsEndWithRoute)
code = APIRouter(prefix="/v1/code", tags=["uploads"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING}, route_class=SessionsEndWithRoute)


def upload_out(upload: Upload) -> UploadOut:
    return UploadOut(
        id=upload.id, kind=upload.kind, name=upload.name, sha256=upload.sha256, size_bytes=upload.size_bytes, created_at=upload.created_at
    )


async def _receive(request: Request, directory, max_bytes: int, name: str | None) -> tuple[uploads.Received, str]:
    """The body's file on disk, and the name to show it by."""
    content_type = request.headers.get("content-type", "")
    try:
        body = uploads.MultipartFile(_whole_body(request), content_type) if content_type.startswith("multipart/form-data") else _whole_body(request)
        received = await uploads.receive(body, directory, max_bytes)
    except uploads.UploadTooLarge as exc:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, str(exc)) from None
    except uploads.UploadRefused as exc:
        raise _refused(exc) from None
    name = name or getattr(body, "filename", None)
    if not name or len(name) > 200 or not re.fullmatch(NAME_PATTERN, name):
        received.path.unlink(missing_ok=True)
        msg = "give ?name= (letters, digits, '_', '.', ' ', '+', '-'; no slashes)" + (f"; the form's file name {name!r} won't do" if name else "")
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": ["query", "name"], "msg": msg, "type": "value_error"}])
    return received, name


async def _whole_body(request: Request) -> AsyncIterator[bytes]:
    """The request body as it arrives. Raises UploadRefused if it ends before its Content-Length,
    whether the client went away or the server was told it was complete."""
    declared, arrived = request.headers.get("content-length"), 0
    try:
        async for chunk in request.stream():
            arrived += len(chunk)
            yield chunk
    except ClientDisconnect:
        raise uploads.UploadRefused("the body ended before its declared length: the connection closed") from None
    if declared is not None and arrived != int(declared):
        raise uploads.UploadRefused(f"the body ended after {arrived} of its declared {declared} bytes")


def _refused(exc: Exception) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": ["body"], "msg": str(exc), "type": "value_error"}])


@datasets.post("", status_code=status.HTTP_201_CREATED, response_model=UploadOut, responses=UPLOAD_ERRORS, openapi_extra=BODY)
async def upload_dataset(request: Request, user: CurrentUser, settings: SettingsDep, name: UploadName = None) -> UploadOut:
    """A dataset file, then usable by your jobs as `"dataset": {"kind": …, "upload_id": ID}`."""
    root = settings.resolved_data_root
    note(request, detail=f"upload dataset {name or ''}".rstrip())
    received, name = await _receive(request, root / "uploads", settings.max_upload_bytes, name)
    uploaded = await _record(settings, user, uploads.DATASET, name, received, received.path, root)
    note(request, detail=f"upload dataset {name} (upload {uploaded.id}, {uploaded.size_bytes} bytes)")
    return uploaded


@code.post("", status_code=status.HTTP_201_CREATED, response_model=UploadOut, responses=UPLOAD_ERRORS, openapi_extra=BODY)
async def upload_code(request: Request, user: CurrentUser, settings: SettingsDep, name: UploadName = None) -> UploadOut:
    """A code bundle (tar, tar.gz or zip), unpacked safely; then usable by your `script` jobs as `"code": {"upload_id": ID}`."""
    root = settings.resolved_artifact_root
    note(request, detail=f"upload code {name or ''}".rstrip())
    received, name = await _receive(request, root / "code", settings.max_upload_bytes, name)
    try:
        unpacked = await run_in_threadpool(
            uploads.unpack_bundle, received.path, root / "code", settings.max_unpacked_bytes, settings.max_unpacked_files
        )
    except uploads.UploadRefused as exc:
        raise _refused(exc) from None
    finally:
        received.path.unlink(missing_ok=True)
    uploaded = await _record(settings, user, uploads.CODE, name, received, unpacked, root)
    note(request, detail=f"upload code {name} (upload {uploaded.id}, {uploaded.size_bytes} bytes)")
    return uploaded


async def _record(settings: Settings, user: User, kind: str, name: str, received: uploads.Received, staged: Path, root: Path) -> UploadOut:
    """The upload's row, in one short transaction that also renames `staged` (the received file, or
    the unpacked bundle) to where its id says under `root`; `staged` is gone afterwards either way."""

    def put_in_place(upload_id: int) -> str:
        relative = uploads.upload_path(kind, upload_id)
        uploads.place(staged, root / relative)
        return relative

    def record() -> Upload:
        with session_factory(settings.resolved_database_url)() as session:
            return create_upload(session, user, kind, name, received.sha256, received.size, put_in_place)

    try:
        return upload_out(await run_in_threadpool(record))
    finally:
        uploads.discard(staged)


def _routes_to_read(router: APIRouter, kind: str) -> None:
    @router.get("", response_model=list[UploadOut], name=f"list_{kind}_uploads")
    def list_uploads(session: SessionDep, user: CurrentUser) -> list[UploadOut]:
        return [upload_out(u) for u in uploads_visible_to(session, user, kind)]

    @router.get("/{upload_id}", response_model=UploadOut, name=f"get_{kind}_upload")
    def get_upload(upload_id: RowId, session: SessionDep, user: CurrentUser) -> UploadOut:
        upload = upload_visible_to(session, user, upload_id, kind)
        if upload is None:
            raise not_found(kind)
        return upload_out(upload)


_routes_to_read(datasets, uploads.DATASET)
_routes_to_read(code, uploads.CODE)
