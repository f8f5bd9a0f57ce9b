"""Uploads: `POST /v1/datasets` (one data file) and `POST /v1/code` (a tar or zip code bundle).

The body is the file itself (`application/octet-stream`) or a `multipart/form-data` form with a
`file` field, streamed to disk as it arrives either way; `?name=` is the file name to show
(default: the form's file name). Uploads are owned by their user: others get 404.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from starlette.concurrency import run_in_threadpool

from api_schemas import UploadOut
from service import uploads
from service.api.deps import MAY_BE_MISSING, NEEDS_TOKEN, CurrentUser, RowId, SessionDep, SettingsDep, not_found
from service.db.models import Upload
from service.db.uploads import create_upload, upload_visible_to, uploads_visible_to

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
    422: {"description": "Empty, or (code) not a safe tar/zip archive within the unpack limits."},
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

datasets = APIRouter(prefix="/v1/datasets", tags=["uploads"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING})
code = APIRouter(prefix="/v1/code", tags=["uploads"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING})


def upload_out(upload: Upload) -> UploadOut:
    return UploadOut(
        id=upload.id, kind=upload.kind, name=upload.name, sha256=upload.sha256, size_bytes=upload.size_bytes, created_at=upload.created_at
    )


async def _receive(request: Request, directory, max_bytes: int, name: str | None) -> tuple[uploads.Received, str]:
    """The body's file on disk, and the name to show it by."""
    content_type = request.headers.get("content-type", "")
    try:
        body = uploads.MultipartFile(request.stream(), content_type) if content_type.startswith("multipart/form-data") else request.stream()
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


def _refused(exc: Exception) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": ["body"], "msg": str(exc), "type": "value_error"}])


@datasets.post("", status_code=status.HTTP_201_CREATED, response_model=UploadOut, responses=UPLOAD_ERRORS, openapi_extra=BODY)
async def upload_dataset(
    request: Request, session: SessionDep, user: CurrentUser, settings: SettingsDep, name: UploadName = None
) -> UploadOut:
    """A dataset file, then usable by your jobs as `"dataset": {"kind": …, "upload_id": ID}`."""
    root = settings.resolved_data_root
    received, name = await _receive(request, root / "uploads", settings.max_upload_bytes, name)

    def put_in_place(upload_id: int) -> str:
        relative = uploads.upload_path(uploads.DATASET, upload_id)
        uploads.place(received, root / relative)
        return relative

    return await _record(session, user, uploads.DATASET, name, received, put_in_place)


@code.post("", status_code=status.HTTP_201_CREATED, response_model=UploadOut, responses=UPLOAD_ERRORS, openapi_extra=BODY)
async def upload_code(
    request: Request, session: SessionDep, user: CurrentUser, settings: SettingsDep, name: UploadName = None
) -> UploadOut:
    """A code bundle (tar, tar.gz or zip), unpacked safely; then usable by your `script` jobs as `"code": {"upload_id": ID}`."""
    root = settings.resolved_artifact_root
    received, name = await _receive(request, root / "code", settings.max_upload_bytes, name)

    def put_in_place(upload_id: int) -> str:
        relative = uploads.upload_path(uploads.CODE, upload_id)
        uploads.unpack_bundle(received.path, root / relative, settings.max_unpacked_bytes, settings.max_unpacked_files)
        return relative

    return await _record(session, user, uploads.CODE, name, received, put_in_place)


async def _record(session, user, kind: str, name: str, received: uploads.Received, put_in_place) -> UploadOut:
    """The upload's row, with its file put in place by `put_in_place(id)` before the row commits;
    the received temporary file is gone afterwards either way."""
    try:
        upload = await run_in_threadpool(create_upload, session, user, kind, name, received.sha256, received.size, put_in_place)
    except uploads.UploadRefused as exc:  # a code bundle that can't be unpacked safely
        raise _refused(exc) from None
    finally:
        received.path.unlink(missing_ok=True)
    return upload_out(upload)


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
