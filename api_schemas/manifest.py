"""The checkpoint manifest: written by the training loop, verified by the artifact store.

A checkpoint directory holds `model.safetensors`, the full Accelerate state and a `manifest.json`
that lists every other file with its size and sha256. A `script` job's checkpoint is whatever its
`accelerator.save_state()` wrote, with no `model.safetensors` unless the script saved one. Standard library only, so both sides share it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MODEL_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"


def checkpoint_name(step: int) -> str:
    """The directory of the checkpoint at `step`, as the training loop writes it and the artifact store keeps it."""
    return f"step-{step:08d}"


class CorruptCheckpoint(Exception):
    pass


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, step: int | None) -> dict:
    # Only the directory's own manifest is left out: a file of that name deeper down is content.
    files = {
        str(path.relative_to(directory)): {"sha256": sha256_file(path), "size": path.stat().st_size}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path != directory / MANIFEST_FILE
    }
    manifest = {"step": step, "files": files}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(directory: Path) -> dict:
    """The manifest as written, without checking the files against it."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        if not isinstance(manifest["files"], dict):
            raise ValueError("'files' is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"{directory}: unreadable manifest ({exc})") from exc
    return manifest


def verify_manifest(directory: Path, moved: bool = False) -> dict:
    """Check every listed file against its size and sha256; returns the manifest.

    `moved`: the directory was renamed, not copied, since its manifest was written, so its files
    are the inodes the manifest's writer hashed. Then a file whose status last changed before the
    manifest was written (ctime: every write moves it on, and unlike mtime no call sets it back) is
    checked by its size alone: hashing it again would read every byte a second time (from the disk,
    for a checkpoint larger than the page cache) to find what the writer's hash found moments before.
    """
    manifest = read_manifest(directory)
    written = (directory / MANIFEST_FILE).stat().st_ctime_ns
    for relative, expected in manifest["files"].items():
        path = directory / relative
        # Not through a link: the directory was written by a job, and its reader may read more than it.
        status = path.lstat() if path.is_file() and not path.is_symlink() else None
        unchanged = moved and status is not None and status.st_ctime_ns < written
        if status is None or status.st_size != expected["size"] or (not unchanged and sha256_file(path) != expected["sha256"]):
            raise CorruptCheckpoint(f"{directory}: {relative} does not match its manifest")
    return manifest
