from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import FileResponse, Response, StreamingResponse
from sqlalchemy.orm import Session

from api_schemas.manifest import MODEL_FILE
from service.api.deps import MAY_BE_MISSING, NEEDS_TOKEN, CurrentUser, RowId, SessionDep, SessionsEndWithRoute, SettingsDep, StoreDep, not_found
from service.api.tar_stream import open_files, stream_tar
from service.db.checkpoints import checkpoint_visible_to, deleted_checkpoint_visible_to, list_checkpoints
from service.db.models import DeletedCheckpoint

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING}, route_class=SessionsEndWithRoute)


@router.get("/{checkpoint_id}/download", response_model=None)
def download_checkpoint(
    checkpoint_id: RowId,
    session: SessionDep,
    user: CurrentUser,
    store: StoreDep,
    settings: SettingsDep,
    format: Annotated[
        Literal["safetensors", "tar"],
        Query(description="`tar`: the full resumable state (always, for a script's checkpoint without model.safetensors)."),
    ] = "safetensors",
) -> Response:
    checkpoint = checkpoint_visible_to(session, user, checkpoint_id)
    if checkpoint is None:
        deleted = deleted_checkpoint_visible_to(session, user, checkpoint_id)
        raise not_found("checkpoint") if deleted is None else _deleted_by_retention(session, deleted)
    directory = store.path(checkpoint.path)
    if not directory.is_dir():
        raise not_found("checkpoint files")  # pruned by retention after the listing was read
    name = f"job{checkpoint.job_id}-step{checkpoint.step}"
    if format == "tar" or not (directory / MODEL_FILE).is_file():  # a script's checkpoint may hold no weights file
        try:
            files = open_files(directory)
        except FileNotFoundError:
            raise not_found("checkpoint files") from None  # retention won the race to the files
        return StreamingResponse(
            stream_tar(files, name),
            media_type="application/x-tar",
            headers={"Content-Disposition": f'attachment; filename="{name}.tar"'},
        )
    if settings.download_redirect_prefix:
        # nginx sends the file (and answers Range requests) once we said who may have it: the bytes
        # then never pass through Python, which capped a download at a fraction of the disk's speed.
        return Response(
            headers={
                "X-Accel-Redirect": f"{settings.download_redirect_prefix}{checkpoint.path}/{MODEL_FILE}",
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f'attachment; filename="{name}.safetensors"',
                "X-Checkpoint-SHA256": checkpoint.sha256,
            }
        )
    # FileResponse answers Range requests (206/416) itself, so interrupted downloads can resume.
    try:
        return OpenedFileResponse(
            directory / MODEL_FILE,
            media_type="application/octet-stream",
            filename=f"{name}.safetensors",
            headers={"X-Checkpoint-SHA256": checkpoint.sha256},
        )
    except FileNotFoundError:
        raise not_found("checkpoint files") from None  # retention won the race to the file


def _deleted_by_retention(session: Session, deleted: DeletedCheckpoint) -> HTTPException:
    """A 404 that says the checkpoint was there, why it is gone, and which of its job's are kept."""
    kept = ", ".join(f"{c.id} (step {c.step})" for c in list_checkpoints(session, deleted.job_id)) or "none"
    return HTTPException(
        status.HTTP_404_NOT_FOUND,
        f"checkpoint {deleted.id} (step {deleted.step} of job {deleted.job_id}) was deleted by the job's "
        f"checkpoint.keep_last retention; kept: {kept}",
    )


class OpenedFileResponse(FileResponse):
    """A FileResponse of a file opened when the route answers, read 1 MiB at a time.

    Opened at once: retention may delete the checkpoint between the route's check and the first
    byte sent, and an open file stays readable after its deletion (Starlette reopens it through
    /proc/self/fd where there is one). 1 MiB, not Starlette's 64 KiB: each chunk costs a thread hop
    and a send, which capped a download near 100 MB/s on a 2-core host (about 600 MB/s with 1 MiB)."""

    chunk_size = 1 << 20

    def __init__(self, path: Path, **kwargs) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        opened = Path(f"/proc/self/fd/{self._fd}")
        super().__init__(opened if opened.exists() else path, stat_result=os.fstat(self._fd), **kwargs)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            os.close(self._fd)
