"""Dataset paths named by job specs, confined to the data root."""

from __future__ import annotations

from pathlib import Path


class DatasetError(ValueError):
    pass


def resolve_dataset(data_root: Path, relative: str) -> Path:
    """The dataset file under `data_root`; refuses paths (symlinks included) that resolve outside it."""
    root = data_root.resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise DatasetError("resolves outside the data root")
    if not path.is_file():
        raise DatasetError(f"no dataset file {relative!r} under the data root")
    if path.stat().st_size == 0:
        raise DatasetError(f"dataset file {relative!r} is empty")
    return path
