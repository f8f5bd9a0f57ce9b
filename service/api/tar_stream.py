"""A stored directory (a checkpoint, a script's output) sent as a tar stream, built as it is sent."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


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


def open_files(directory: Path) -> list[tuple[str, BinaryIO]]:
    """Every file under `directory` (symbolic links left out), opened now: retention, or a newer
    collection of a script's output, may delete the directory while the tar streams, and open files
    stay readable after that."""
    return [
        (path.relative_to(directory).as_posix(), open(path, "rb"))
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not path.is_symlink()
    ]


def stream_tar(files: list[tuple[str, BinaryIO]], top: str) -> Iterator[bytes]:
    """The files as an uncompressed tar, each under `top/`, a piece at a time; closes them at the end."""
    out = _Chunks()
    try:
        with tarfile.open(fileobj=out, mode="w|") as tar:
            for name, file in files:
                info = tarfile.TarInfo(f"{top}/{name}")
                info.size, info.mode = os.fstat(file.fileno()).st_size, 0o644
                tar.addfile(info, file)
                yield from out.drain()
        yield from out.drain()
    finally:
        for _, file in files:
            file.close()
