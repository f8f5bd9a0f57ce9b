"""The worker's hands on what a job wrote, never following a link.

The worker runs as root; a job's files are the job's to change at any moment, from inside its
sandbox. Checked by path and then used by path, a directory could be swapped for a link in
between: a trial moved another user's checkpoint into its own job, had the worker delete a
root-only directory, and copied the host's token and the service's logs out as its outputs. So a
path inside the attempt's directory is walked one component at a time from a descriptor of that
directory, each opened O_NOFOLLOW, and what the worker takes is first moved (a checkpoint) or
copied (an output) out of the job's reach: everything after works on the worker's own copy.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from pathlib import Path

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotTheJobs(OSError):
    """A path that is not a directory of the attempt's, reached without a link (a link, a file, gone)."""


class OverBudget(OSError):
    """An output larger than the worker copies (its files' sizes, sparse files counted whole)."""


def handover_directory(run_dir: Path) -> Path:
    """Where the worker keeps what it took from the attempt: beside its directory, on its filesystem
    (a move is a rename), not in the sandbox's view. Removed with the attempt's directory."""
    return Path(os.path.realpath(run_dir) + ".handover")


def take_out(run_dir: Path, path: Path) -> Path:
    """Move the directory `path` (inside `run_dir`, as the job named it) to the handover directory;
    where it is now. Raises NotTheJobs if it is not a directory of the attempt's."""
    relative = _relative(run_dir, path)
    into = handover_directory(run_dir)
    into.mkdir(mode=0o700, exist_ok=True)
    target = into / f"{uuid.uuid4().hex}-{relative.name}"
    parent = _open_beneath(run_dir, relative.parent)
    try:
        try:
            os.rename(relative.name, target, src_dir_fd=parent)  # the entry itself: a link is moved, not followed
        except OSError as exc:
            raise NotTheJobs(exc.errno, f"{path}: {exc.strerror}") from exc
        if not stat.S_ISDIR(os.lstat(target).st_mode):
            os.rename(target, relative.name, dst_dir_fd=parent)  # the job's link or file, left as it was
            raise NotTheJobs(f"{path} is not a directory (a link, or a file)")
    finally:
        os.close(parent)
    return target


def copy_out(run_dir: Path, path: Path, name: str, max_bytes: int) -> Path:
    """Copy the directory `path` (inside `run_dir`) as it is now into the handover directory, as
    `name` in a new folder of its own: directories and regular files only, no link followed, at
    most `max_bytes`. Returns that folder (the store takes it in whole: the only copy made)."""
    source = _open_beneath(run_dir, _relative(run_dir, path))
    into = handover_directory(run_dir)
    into.mkdir(mode=0o700, exist_ok=True)
    folder = into / uuid.uuid4().hex
    try:
        _copy(source, folder / name, [max_bytes])
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        os.close(source)
    return folder


def _relative(run_dir: Path, path: Path) -> Path:
    """`path` relative to `run_dir` (as named, or its real path: a warm attempt's is a link the
    worker made), read lexically: resolving it would follow the job's links."""
    normal = Path(os.path.normpath(path))
    for root in (run_dir, Path(os.path.realpath(run_dir))):
        if path.is_absolute() and normal.is_relative_to(root) and normal != root:
            return normal.relative_to(root)
    raise NotTheJobs(f"{path} is not inside the attempt's directory {run_dir}")


def _open_beneath(run_dir: Path, relative: Path) -> int:
    """A descriptor of directory `relative` under `run_dir` (the worker's own: it may be a link the
    worker made), reached without following any link of the job's."""
    descriptor = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for part in relative.parts:
        try:
            inner = os.open(part, _DIRECTORY, dir_fd=descriptor)
        except OSError as exc:
            raise NotTheJobs(exc.errno, f"{relative}: {part!r} is not a directory of the attempt's ({exc.strerror})") from exc
        finally:
            os.close(descriptor)
        descriptor = inner
    return descriptor


def _copy(source: int, destination: Path, budget: list[int]) -> None:
    destination.mkdir(mode=0o700, parents=True)  # (parents: an output's name may have several parts)
    with os.scandir(source) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                try:
                    inner = os.open(entry.name, _DIRECTORY, dir_fd=source)
                except OSError:  # swapped for a link or a file since it was listed: left out
                    continue
                try:
                    _copy(inner, destination / entry.name, budget)
                finally:
                    os.close(inner)
            elif entry.is_file(follow_symlinks=False):
                try:  # O_NONBLOCK: a FIFO swapped in would block the open
                    descriptor = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=source)
                except OSError:
                    continue
                with open(descriptor, "rb") as file:
                    status = os.fstat(descriptor)
                    if not stat.S_ISREG(status.st_mode):
                        continue
                    budget[0] -= status.st_size
                    if budget[0] < 0:
                        raise OverBudget(f"over the {_gb(budget[0] + status.st_size)} GB left to copy at {entry.name!r} "
                                         f"({status.st_size / 2**30:.2f} GB, sparse files counted whole)")
                    with open(destination / entry.name, "wb", opener=lambda path, flags: os.open(path, flags, 0o600)) as copy:
                        left = status.st_size  # as it was measured: what the job appends meanwhile is not counted, nor copied
                        while left > 0 and (chunk := file.read(min(left, 2**20))):
                            copy.write(chunk)
                            left -= len(chunk)


def _gb(size: int) -> str:
    return f"{max(size, 0) / 2**30:.2f}"
