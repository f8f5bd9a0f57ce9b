"""Dataset paths named by job specs, confined to the data root."""

from __future__ import annotations

from pathlib import Path

from api_schemas.labelled_data import LabelledDataError, read_labelled


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


def check_labelled(path: Path, kind: str, text_column: str, label_column: str, num_labels: int) -> None:
    """Refuse what training would fail on: unreadable rows, missing columns, a label count other than num_labels."""
    try:
        _, labels = read_labelled(path, kind, text_column, label_column)
    except LabelledDataError as exc:
        raise DatasetError(str(exc)) from None
    found = sorted(set(labels))
    if len(found) != num_labels:
        shown = ", ".join(found[:10]) + (" …" if len(found) > 10 else "")
        raise DatasetError(f"holds {len(found)} distinct labels ({shown}) but model.num_labels is {num_labels}")
