"""A stored directory (a checkpoint, a script's output) sent as a tar stream, built as it is sent."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple


class _Chunks(io.RawIOBase):
    """A write-only file that collects what tarfile writes, so it can be streamed out piecewise."""

    def __init__(self) -> None:
        self.pending: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.pending.append(bytes(data))
        return len(data)

    def drain(self) -> Iterator[bytes]:
        yield from self.pending
        self.pending.clear()


# Files opened before the answer starts; the rest as the tar reaches them. All of them at once took
# one descriptor each: an output of 20,000 files was a 500 (too many open files) for its owner.
OPEN_AHEAD = 256


class StoredFile(NamedTuple):
    name: str  # under the directory, as the tar names it
    path: Path
    opened: BinaryIO | None  # opened ahead, or None: opened when the tar reaches it


def open_files(directory: Path) -> list[StoredFile]:
    """Every file under `directory` (symbolic links left out), the first OPEN_AHEAD opened now:
    retention, or a newer collection of a script's output, may delete the directory while the tar
    streams, and open files stay readable after that (one deleted before the tar reaches it cuts
    the stream short, which the client's check of the manifest tells)."""
    paths = [path for path in sorted(directory.rglob("*")) if path.is_file() and not path.is_symlink()]
    return [
        StoredFile(path.relative_to(directory).as_posix(), path, open(path, "rb") if number < OPEN_AHEAD else None)
        for number, path in enumerate(paths)
    ]


def stream_tar(files: list[StoredFile], top: str) -> Iterator[bytes]:
    """The files as an uncompressed tar, each under `top/`, a piece at a time; closes them at the end."""
    out = _Chunks()
    try:
        with tarfile.open(fileobj=out, mode="w|") as tar:
            for name, path, opened in files:
                with opened or open(path, "rb") as file:
                    info = tarfile.TarInfo(f"{top}/{name}")
                    info.size, info.mode = os.fstat(file.fileno()).st_size, 0o644
                    tar.addfile(info, file)
                yield from out.drain()
        yield from out.drain()
    finally:
        for _, _, opened in files:
            if opened is not None:
                opened.close()
