"""The checkpoint store: a directory tree shared by the API (reads) and workers (writes).

A checkpoint enters the store by copy into a temporary directory, verification against its
manifest, and an atomic rename; only then is it recorded in the database. So a listed checkpoint
is always complete, and a crash mid-copy leaves only a `.tmp-*` directory nobody reads.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from api_schemas.manifest import MANIFEST_FILE, MODEL_FILE, sha256_file, verify_manifest


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
        """Copy a finished checkpoint directory in; returns (relative path, sha256, size) of its
        model.safetensors, or for a checkpoint without one (a script's), of its manifest.json and
        the total size of its files."""
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
        if model := manifest["files"].get(MODEL_FILE):
            return relative, model["sha256"], model["size"]
        total = sum(entry["size"] for entry in manifest["files"].values())
        return relative, sha256_file(final / MANIFEST_FILE), total

    def delete(self, relative: str) -> None:
        shutil.rmtree(self.path(relative), ignore_errors=True)
