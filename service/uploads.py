"""Uploaded files: datasets (one file under the data root) and code bundles (a tar or zip archive,
unpacked under the artifact root).

Both arrive the same way: the request body is streamed into a temporary file next to where it
will live, hashed and counted as it comes (over `max_bytes` stops it), a code bundle is unpacked
into a temporary directory beside it, and only a complete, checked upload is renamed into place,
in the short transaction that records it (no transaction is open while the body arrives). A code bundle is unpacked member by member, by us rather than
by tarfile/zipfile, so nothing can land outside its directory: no absolute paths, no `..`, no links,
no devices, and limits on the total size and the number of files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tarfile
import uuid
import zipfile
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from api_schemas.jobs import UPLOADS_DIR, CodeSource
from common.settings import Settings

DATASET, CODE = "dataset", "code"
COPY_CHUNK = 1 << 20


class UploadTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"upload larger than {limit} bytes")
        self.limit = limit


class UploadRefused(ValueError):
    """The upload can't be used: empty, not an archive, or an archive member that is unsafe or over a limit."""


@dataclass(frozen=True)
class Received:
    path: Path
    sha256: str
    size: int


def upload_path(kind: str, upload_id: int) -> str:
    """Where an upload lives, relative to its root (the data root for datasets, the artifact root for code)."""
    return f"{UPLOADS_DIR}/{upload_id}" if kind == DATASET else f"code/{upload_id}"


FILE_FIELD = "file"  # the multipart form field that carries the upload


class MultipartFile:
    """The `file` part of a multipart/form-data body, as its bytes arrive: `async for chunk in
    MultipartFile(stream, content_type)`. Nothing is buffered beyond one network chunk, so the
    upload goes to disk (and through the size limit) as it comes, like a raw body. `filename` is
    the part's file name, known once its headers have been read."""

    def __init__(self, stream: AsyncIterator[bytes], content_type: str):
        from python_multipart.multipart import MultipartParser, parse_options_header

        self._parse_options = parse_options_header
        _, options = parse_options_header(content_type)
        if not options.get(b"boundary"):
            raise UploadRefused("a multipart body needs a boundary")
        self.stream, self.filename, self.found, self.complete = stream, None, False, False
        self._pending: list[bytes] = []
        self._field, self._value, self._headers, self._in_file = b"", b"", {}, False
        self._parser = MultipartParser(options[b"boundary"], {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda data, start, end: self._header_add("field", data[start:end]),
            "on_header_value": lambda data, start, end: self._header_add("value", data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_end": self._end,
        })

    def _part_begin(self) -> None:
        self._headers, self._field, self._value, self._in_file = {}, b"", b"", False

    def _header_add(self, which: str, data: bytes) -> None:
        if which == "field":
            self._field += data
        else:
            self._value += data

    def _header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = self._parse_options(self._headers.get(b"content-disposition", b""))
        if options.get(b"name") == FILE_FIELD.encode() and not self.found:
            self.found, self._in_file = True, True
            filename = options.get(b"filename")
            self.filename = PurePosixPath(filename.decode("utf-8", "replace").replace("\\", "/")).name if filename else None

    def _end(self) -> None:
        self.complete = True

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self._pending.append(bytes(data[start:end]))

    async def __aiter__(self):
        from python_multipart.exceptions import MultipartParseError

        async for chunk in self.stream:
            try:
                self._parser.write(chunk)
            except MultipartParseError as exc:
                raise UploadRefused(f"malformed multipart body: {exc}") from None
            pending, self._pending = self._pending, []
            for data in pending:
                yield data
        if not self.complete:  # a body cut short: what arrived of the file may be only its start
            raise UploadRefused("the multipart body ends before its closing boundary")
        if not self.found:
            raise UploadRefused(f"the multipart body has no `{FILE_FIELD}` field")


async def receive(chunks: AsyncIterator[bytes], directory: Path, max_bytes: int) -> Received:
    """Stream `chunks` into a new temporary file in `directory`, hashing as it goes.

    Raises UploadTooLarge past `max_bytes` and UploadRefused for an empty upload; either way (and on
    a dropped connection) the temporary file is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".tmp-{uuid.uuid4().hex}"
    digest, size = hashlib.sha256(), 0
    try:
        with open(path, "wb") as out:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise UploadTooLarge(max_bytes)
                digest.update(chunk)
                out.write(chunk)
        if size == 0:
            raise UploadRefused("the upload is empty")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return Received(path, digest.hexdigest(), size)


def code_directory(settings: Settings, code: CodeSource) -> Path:
    """A script job's code: an uploaded bundle (under the artifact root), or a directory under the
    code root. Raises UploadRefused if it is missing or a path resolves outside the code root."""
    if code.upload_id is not None:
        directory = settings.resolved_artifact_root / upload_path(CODE, code.upload_id)
    else:
        root = settings.resolved_code_root
        directory = (root / code.path).resolve()
        if not directory.is_relative_to(root):
            raise UploadRefused("resolves outside the code root")
    if not directory.is_dir():
        raise UploadRefused("no such code directory" if code.path is not None else f"no code bundle {code.upload_id}")
    return directory


def place(staged: Path, final: Path) -> None:
    """Rename a received file or unpacked bundle directory into place (same file system: atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, final)


def discard(staged: Path) -> None:
    """Remove a received file or unpacked directory that was not placed (no error if it was)."""
    if staged.is_dir():
        shutil.rmtree(staged, ignore_errors=True)
    else:
        staged.unlink(missing_ok=True)


def unpack_bundle(archive: Path, directory: Path, max_bytes: int, max_files: int) -> Path:
    """Unpack a tar (plain or compressed) or zip archive, safely, into a new temporary directory in
    `directory`, returned for `place` to rename once the upload is recorded; the archive can take a
    while to unpack, and no transaction waits for it. Raises UploadRefused naming the first bad
    member, having removed what it unpacked."""
    staging = directory / f".tmp-{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        if zipfile.is_zipfile(archive):
            _unpack_zip(archive, staging, _Budget(max_bytes, max_files))
        elif _is_tar(archive):
            _unpack_tar(archive, staging, _Budget(max_bytes, max_files))
        else:
            raise UploadRefused("a code bundle must be a tar (.tar, .tar.gz, .tgz) or zip archive")
        if not any(staging.iterdir()):
            raise UploadRefused("the archive holds no files")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def _is_tar(path: Path) -> bool:
    try:
        return tarfile.is_tarfile(path)
    except (EOFError, zlib.error):  # compressed, but cut short or corrupt: unpacking says so
        return True
    except OSError:
        return False


class _Budget:
    """What is left of the size and file-count limits as members are unpacked."""

    def __init__(self, max_bytes: int, max_files: int):
        self.max_bytes, self.max_files = max_bytes, max_files
        self.bytes = self.files = 0

    def add_file(self) -> None:
        self.files += 1
        if self.files > self.max_files:
            raise UploadRefused(f"the archive holds more than {self.max_files} files and directories")

    def add_bytes(self, count: int) -> None:
        self.bytes += count
        if self.bytes > self.max_bytes:
            raise UploadRefused(f"the archive unpacks to more than {self.max_bytes} bytes")


def _safe_relative(name: str) -> PurePosixPath:
    """An archive member's name as a path inside the bundle; refuses absolute paths and `..`."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or (path.parts and path.parts[0].endswith(":")):
        raise UploadRefused(f"archive member {name!r}: absolute paths are not allowed")
    if ".." in path.parts:
        raise UploadRefused(f"archive member {name!r}: '..' is not allowed")
    parts = [part for part in path.parts if part not in ("", ".")]
    return PurePosixPath(*parts) if parts else PurePosixPath()


def _write(source, target: Path, budget: _Budget, executable: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "xb") as out:  # x: a name twice in one archive is refused below, not overwritten
        while block := source.read(COPY_CHUNK):
            budget.add_bytes(len(block))  # counted as written: a header's declared size can lie
            out.write(block)
    target.chmod(0o755 if executable else 0o644)


def _unpack_tar(archive: Path, dest: Path, budget: _Budget) -> None:
    try:
        with tarfile.open(archive) as tar:
            for member in tar:
                _unpack_member(member.name, dest, budget, _tar_kind(member), lambda m=member: tar.extractfile(m), member.mode)
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise UploadRefused(f"the tar archive is unreadable: {exc}") from None


def _tar_kind(member: tarfile.TarInfo) -> str:
    if member.issym() or member.islnk():
        return "link"
    return "dir" if member.isdir() else "file" if member.isfile() else "other"


def _unpack_zip(archive: Path, dest: Path, budget: _Budget) -> None:
    try:
        with zipfile.ZipFile(archive) as bundle:
            for info in bundle.infolist():
                mode = info.external_attr >> 16  # the Unix mode, when the archiver recorded one
                if stat.S_ISLNK(mode):
                    kind = "link"
                elif stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # 0: type not recorded
                    kind = "other"
                else:
                    kind = "dir" if info.is_dir() else "file"
                _unpack_member(info.filename, dest, budget, kind, lambda i=info: bundle.open(i), mode)
    except zipfile.BadZipFile as exc:
        raise UploadRefused(f"the zip archive is unreadable: {exc}") from None


def _unpack_member(name: str, dest: Path, budget: _Budget, kind: str, open_member, mode: int) -> None:
    relative = _safe_relative(name)
    budget.add_file()
    if kind == "link":
        raise UploadRefused(f"archive member {name!r}: links are not allowed")
    if kind == "other":
        raise UploadRefused(f"archive member {name!r}: only files and directories are allowed")
    try:
        if kind == "dir":
            (dest / relative).mkdir(parents=True, exist_ok=True)
            return
        if not relative.parts:
            raise UploadRefused(f"archive member {name!r}: a file needs a name")
        with open_member() as source:
            _write(source, dest / relative, budget, bool(mode & 0o111))
    except FileExistsError:
        raise UploadRefused(f"archive member {name!r}: the name is used twice") from None
    except (OSError, zipfile.BadZipFile) as exc:
        raise UploadRefused(f"archive member {name!r} cannot be unpacked: {exc}") from None
