"""The checkpoint store: a directory tree shared by the API (reads) and workers (writes).

A checkpoint enters the store by copy into a temporary directory, verification against its
manifest, and an atomic rename; only then is it recorded in the database. So a listed checkpoint
is always complete, and a crash mid-copy leaves only a `.tmp-*` directory nobody reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

MODEL_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"


class CorruptCheckpoint(Exception):
    pass


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_manifest(directory: Path) -> dict:
    """Check every file listed in the manifest against its sha256 and size; returns the manifest."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise CorruptCheckpoint(f"{directory}: unreadable manifest ({exc})") from exc
    if MODEL_FILE not in files:
        raise CorruptCheckpoint(f"{directory}: manifest lists no {MODEL_FILE}")
    for relative, expected in files.items():
        path = directory / relative
        if not path.is_file() or path.stat().st_size != expected["size"] or sha256_file(path) != expected["sha256"]:
            raise CorruptCheckpoint(f"{directory}: {relative} does not match its manifest")
    return manifest


class ArtifactStore:
    def __init__(self, root: Path):
        self.root = root.resolve()

    def path(self, relative: str) -> Path:
        """Absolute path of a stored item; refuses anything that would land outside the root."""
        path = (self.root / relative).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"{relative!r} is outside the artifact store")
        return path

    def ingest_checkpoint(self, source: Path, job_id: int, step: int) -> tuple[str, str, int]:
        """Copy a finished checkpoint directory in; returns (relative path, model sha256, model size)."""
        relative = f"jobs/{job_id}/checkpoints/step-{step:08d}"
        final = self.path(relative)
        final.parent.mkdir(parents=True, exist_ok=True)
        if not final.exists():
            staging = final.parent / f".tmp-{uuid.uuid4().hex}"
            shutil.copytree(source, staging)
            try:
                verify_manifest(staging)
                os.replace(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        manifest = verify_manifest(final)
        model = manifest["files"][MODEL_FILE]
        return relative, model["sha256"], model["size"]

    def delete(self, relative: str) -> None:
        shutil.rmtree(self.path(relative), ignore_errors=True)
