"""A script job's output directories (`script.outputs`): listed, and each downloaded as a tar."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from api_schemas import OutputOut
from service.api.deps import MAY_BE_MISSING, NEEDS_TOKEN, SessionDep, SessionsEndWithRoute, StoreDep, VisibleJob, not_found
from service.api.tar_stream import open_files, stream_tar
from service.api.views import output_out
from service.db.outputs import find_output, list_outputs

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses={**NEEDS_TOKEN, **MAY_BE_MISSING}, route_class=SessionsEndWithRoute)


@router.get("/{job_id}/outputs", response_model=list[OutputOut])
def get_outputs(job: VisibleJob, session: SessionDep) -> list[OutputOut]:
    return [output_out(output) for output in list_outputs(session, job.id)]


@router.get(
    "/{job_id}/outputs/{name:path}",
    response_model=None,
    responses={200: {"content": {"application/x-tar": {}}, "description": "`job<ID>-output/manifest.json` and the directory under its name."}},
)
def download_output(job: VisibleJob, name: str, session: SessionDep, store: StoreDep) -> StreamingResponse:
    """The output as last collected: a tar of the directory under its name beside a manifest.json of
    every file's size and sha256, to check it against once unpacked."""
    output = find_output(session, job.id, name)
    if output is None:
        raise not_found("output")
    directory = store.path(output.path)
    try:
        if not directory.is_dir():
            raise FileNotFoundError(directory)
        files = open_files(directory)
    except FileNotFoundError:
        raise not_found("output files") from None  # a newer collection replaced it after the row was read
    top = f"job{job.id}-output"
    return StreamingResponse(
        stream_tar(files, top), media_type="application/x-tar", headers={"Content-Disposition": f'attachment; filename="{top}.tar"'}
    )
