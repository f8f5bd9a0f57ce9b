"""Labelled texts for a classifier, read from JSON lines, CSV or a `datasets.save_to_disk` directory.

Plain Python (and `datasets`, imported only for a directory), shared: the API checks a dataset
with it at submit, the training loop trains on it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path


class LabelledDataError(ValueError):
    pass


def read_labelled(path: Path, kind: str, text_column: str, label_column: str) -> tuple[list[str], list[str]]:
    """(texts, labels) of a JSON-lines or CSV file; labels as strings, whatever their type there."""
    try:
        return _read_labelled(path, kind, text_column, label_column)
    except UnicodeDecodeError:  # a spreadsheet's export in Latin-1 or UTF-16, say
        raise LabelledDataError("is not UTF-8 text: save it as UTF-8") from None
    except csv.Error as exc:
        raise LabelledDataError(f"is not readable as CSV: {exc}") from None


def _read_labelled(path: Path, kind: str, text_column: str, label_column: str) -> tuple[list[str], list[str]]:
    texts, labels = [], []
    with open(path, encoding="utf-8", newline="") as f:
        if kind == "csv":
            reader = csv.DictReader(f)
            rows = ((reader.line_num, row) for row in reader)
            missing = [c for c in (text_column, label_column) if c not in (reader.fieldnames or [])]
            if missing:
                raise LabelledDataError(f"no column {missing[0]!r} in the CSV header {reader.fieldnames}")
        else:
            rows = ((number, _json_object(line, number)) for number, line in enumerate(f, 1) if line.strip())
        for number, row in rows:
            for column in (text_column, label_column):
                if row.get(column) in (None, ""):
                    raise LabelledDataError(f"line {number} has no {column!r}")
            texts.append(str(row[text_column]))
            labels.append(str(row[label_column]))
    if not texts:
        raise LabelledDataError("holds no examples")
    return texts, labels


def _json_object(line: str, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise LabelledDataError(f"line {number} is not JSON: {exc.msg}") from None
    if not isinstance(row, dict):
        raise LabelledDataError(f"line {number} is not a JSON object")
    return row


def read_disk_dataset(path: Path, split: str | None, text_column: str, label_column: str | None) -> tuple[list[str], list[str] | None]:
    """(texts, labels) of a directory written by `datasets` save_to_disk; labels as strings (a
    ClassLabel's names), None without a label column."""
    try:
        import datasets
    except ImportError:
        raise LabelledDataError("reading a `hf_disk` dataset needs the datasets package: pip install 'trainyard[hf]'") from None
    datasets.disable_progress_bars()
    try:
        data = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as exc:  # not one, or unreadable
        raise LabelledDataError(f"is not a directory written by save_to_disk ({exc})") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise LabelledDataError(f"holds the splits {sorted(data)}: dataset.split must name one of them, not {split!r}")
        data = data[split]
    elif split is not None:
        raise LabelledDataError(f"holds a single split, so dataset.split must be null, not {split!r}")
    for column in (text_column, label_column):
        if column is not None and column not in data.column_names:
            raise LabelledDataError(f"no column {column!r} among {data.column_names}")
    texts = data[text_column]
    for number, text in enumerate(texts, 1):
        if not isinstance(text, str) or not text:
            raise LabelledDataError(f"row {number} has no text in {text_column!r}")
    if not texts:
        raise LabelledDataError("holds no examples")
    if label_column is None:
        return texts, None
    feature = data.features[label_column]
    names = feature.names if isinstance(feature, datasets.ClassLabel) else None
    labels = [names[value] if names else str(value) for value in data[label_column]]
    return texts, labels
