"""The checkpoint store: a directory tree shared by the API (reads) and workers (writes). It also
keeps a script job's output directories (`script.outputs`), each collection in a folder of its own.

A checkpoint enters the store by a move (same filesystem) or a copy into a temporary directory,
verification against its manifest (a moved file unchanged since its manifest was written is not
hashed again), and an atomic rename; only then is it recorded in the database. So a listed
checkpoint is always complete, and a crash mid-copy leaves only a `.tmp-*` directory nobody reads.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from api_schemas.manifest import (
    MANIFEST_FILE, MODEL_FILE, CorruptCheckpoint, checkpoint_name, read_manifest, sha256_file, verify_manifest, write_manifest,
)


INCOMING = "incoming"  # a job's uploads from hosts without the store, until sealed
MARK_FILE = ".trainyard-mark"  # in the artifact root and the data root: which service's they are


def directory_mark(root: Path, make: bool = False) -> str | None:
    """The id written in `root`'s mark file: the API makes it (`make`), and a host that says it shares
    the directory must read the same one where it mounts it, or it would write where the API never
    looks (checkpoints no one can register) and read data the API never checked. None if there is none."""
    path = root / MARK_FILE
    if make and not path.exists():
        try:
            root.mkdir(parents=True, exist_ok=True)
            with open(path, "x") as file:  # two API processes at once: one writes it, the other reads it
                file.write(uuid.uuid4().hex)
        except FileExistsError:
            pass
        except OSError:  # mounted read-only here: there is no mark, and hosts are not checked against one
            return None
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class ArtifactStore:
    def __init__(self, root: Path, reader_gid: int | None = None):
        """`reader_gid`: a group given read access to stored checkpoints (a proxy's workers: Settings.artifact_reader_gid)."""
        self.root, self.reader_gid = root.resolve(), reader_gid

    def path(self, relative: str) -> Path:
        """Absolute path of a stored item; refuses anything that would land outside the root."""
        path = (self.root / relative).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"{relative!r} is outside the artifact store")
        return path

    def ingest_checkpoint(
        self, source: Path, job_id: int, step: int, folder: str | None = None, hashed_here: bool = True
    ) -> tuple[str, str, int]:
        """Take a finished checkpoint directory in, as `folder` under the job's checkpoints (by
        default the built-in loop's `step-…` name); returns (relative path, sha256, size) of its
        model.safetensors, or for a checkpoint without one (a script's), of its manifest.json and
        the total size of its files. `hashed_here`: its manifest was written on this machine by a
        writer we trust to have hashed what it listed (False for an upload: every byte is hashed).
        The directory is moved in when it is on the store's
        filesystem (its writer hands it over: a copy would cost a second write of every byte on
        the training host, and its files need no second hash unless changed since their manifest),
        else copied; either way verified before it is renamed into place. A checkpoint already
        stored (a retry after the database missed it) is described as it is."""
        relative = f"jobs/{job_id}/checkpoints/{folder or checkpoint_name(step)}"
        final = self.path(relative)
        if final.exists():
            manifest = read_manifest(final)  # verified on the way in
        else:
            if not source.is_dir():
                raise CorruptCheckpoint(f"{source} is gone")
            final.parent.mkdir(parents=True, exist_ok=True)
            staging = final.parent / f".tmp-{uuid.uuid4().hex}"
            moved = _move_or_copy(source, staging)
            try:
                manifest = verify_manifest(staging, moved and hashed_here)
                _take_ownership(staging, self.reader_gid)
                self._open_to_readers(final.parent)
                os.replace(staging, final)
            except BaseException:
                if moved:
                    os.rename(staging, source)  # left where it was, as a copy would have left it
                else:
                    shutil.rmtree(staging, ignore_errors=True)
                raise
        if model := manifest["files"].get(MODEL_FILE):
            return relative, model["sha256"], model["size"]
        total = sum(entry["size"] for entry in manifest["files"].values())
        return relative, sha256_file(final / MANIFEST_FILE), total

    def ingest_output(self, source: Path, job_id: int, name: str, step: int | None) -> tuple[str, str, int, int]:
        """Copy a script's output directory in as it is now: into a new folder under the job's
        outputs, as `name` beside a manifest.json of its files. Returns (relative path of that
        folder, sha256 of its manifest, total size, number of files). Only directories and regular
        files are copied: a symbolic link may name any file of the worker host, a FIFO would block."""
        return self._output_in(job_id, step, lambda staging: shutil.copytree(source, staging / name, ignore=links_and_special_files))

    def hand_over_output(self, folder: Path, job_id: int, step: int | None) -> tuple[str, str, int, int]:
        """Take in an output its writer hands over: `folder` holds it under its name and nothing
        else, only directories and regular files (the worker's copy of what a job wrote). Moved
        in (copied if on another filesystem). Returns what ingest_output does."""
        return self._output_in(job_id, step, lambda staging: _move_or_copy(folder, staging))

    def _output_in(self, job_id: int, step: int | None, fill: Callable[[Path], object]) -> tuple[str, str, int, int]:
        """A new folder under the job's outputs: `fill`ed at a staging path, given a manifest, renamed into place."""
        relative = f"jobs/{job_id}/outputs/{uuid.uuid4().hex}"
        final = self.path(relative)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            fill(staging)
            manifest = write_manifest(staging, step)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        sizes = [entry["size"] for entry in manifest["files"].values()]
        return relative, sha256_file(final / MANIFEST_FILE), sum(sizes), len(sizes)

    # -- what hosts without the store's filesystem send through the API (service/api/routes/host_transfers.py)

    def upload_dir(self, job_id: int, attempt_id: int, upload_id: str) -> Path:
        """Where one upload's files gather until it is sealed: beside the job's items, on their filesystem."""
        return self.path(f"jobs/{job_id}/{INCOMING}/{attempt_id}-{upload_id}")

    def drop_uploads(self, job_id: int, which: Callable[[list[int]], list[int]]) -> None:
        """Delete the unsealed uploads of those of the job's attempts with any that `which` picks (an upload
        not sealed when its attempt ended never will be)."""
        incoming = self.path(f"jobs/{job_id}/{INCOMING}")
        found: dict[int, list[Path]] = {}
        for directory in incoming.iterdir() if incoming.is_dir() else ():
            attempt, _, _ = directory.name.partition("-")
            if attempt.isdigit():
                found.setdefault(int(attempt), []).append(directory)
        for attempt in which(list(found)) if found else ():
            for directory in found[attempt]:
                shutil.rmtree(directory, ignore_errors=True)

    def seal_output(self, staging: Path, job_id: int, upload_id: str, name: str) -> tuple[str, str, int, int]:
        """Take an uploaded output in (`name/…` beside its manifest.json), every file verified, at a
        folder its upload names, so a seal sent again finds it. Returns what ingest_output does."""
        relative = f"jobs/{job_id}/outputs/{upload_id}"
        final = self.path(relative)
        if not final.exists():
            if not staging.is_dir():
                raise CorruptCheckpoint("nothing was uploaded")
            manifest = read_manifest(staging)
            top = PurePosixPath(name).parts[0]
            if any(not path.startswith(f"{name}/") for path in manifest["files"]) or {p.name for p in staging.iterdir()} - {top, MANIFEST_FILE}:
                raise CorruptCheckpoint(f"an output's upload holds only {name}/ and its manifest")
            verify_manifest(staging)
            _take_ownership(staging, self.reader_gid)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, final)
        manifest = read_manifest(final)
        sizes = [entry["size"] for entry in manifest["files"].values()]
        return relative, sha256_file(final / MANIFEST_FILE), sum(sizes), len(sizes)

    def _open_to_readers(self, directory: Path) -> None:
        """With a reader group: `directory` and those above it up to the root theirs to pass through
        (made by a process whose files only it may read: the service's umask is 077)."""
        if self.reader_gid is None:
            return
        for path in [directory, *directory.parents]:
            _readable_by(path, self.reader_gid)
            if path == self.root or not path.is_relative_to(self.root):
                break

    def delete(self, relative: str) -> None:
        """Delete a stored checkpoint (its directory, or the folder of its own a script's is kept in), or an output's folder."""
        top = PurePosixPath(*PurePosixPath(relative).parts[:4])  # jobs/<id>/{checkpoints,outputs}/<folder>
        shutil.rmtree(self.path(str(top)), ignore_errors=True)


def _take_ownership(directory: Path, reader_gid: int | None = None) -> None:
    """The service's own from now on: written in a sandbox by the job's user id, readable by the
    service account only (a later attempt that resumes from it gets a copy), and by `reader_gid`'s
    members if given (a proxy that sends downloads). Links are dropped: a job could point one at
    any file this process may read, for a download to send."""
    for path in [directory, *directory.rglob("*")]:
        if path.is_symlink():
            path.unlink()
            continue
        if os.geteuid() == 0:
            os.chown(path, 0, 0)
        path.chmod(0o700 if path.is_dir() else 0o600)
        if reader_gid is not None:
            _readable_by(path, reader_gid)


def _readable_by(path: Path, gid: int) -> None:
    """`path` readable (a directory: listable and passable) by group `gid`, and by no one else it was not."""
    status = path.stat()
    if status.st_gid != gid:
        os.chown(path, -1, gid)
    wanted = status.st_mode | (0o050 if stat.S_ISDIR(status.st_mode) else 0o040)
    if stat.S_IMODE(wanted) != stat.S_IMODE(status.st_mode):
        path.chmod(stat.S_IMODE(wanted))


def _move_or_copy(source: Path, destination: Path) -> bool:
    """True if moved (same filesystem), False if copied."""
    try:
        os.rename(source, destination)
        return True
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    shutil.copytree(source, destination)
    return False


def links_and_special_files(directory: str, names: list[str]) -> list[str]:
    """copytree's `ignore`: the entries that are neither a directory nor a regular file, links not followed."""
    return [name for name in names if not _plain(os.lstat(os.path.join(directory, name)).st_mode)]


def _plain(mode: int) -> bool:
    return stat.S_ISDIR(mode) or stat.S_ISREG(mode)
