"""Labelled texts for a classifier, read from JSON lines or CSV.

Plain Python, shared: the API checks a file with it at submit, the training loop trains on it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path


class LabelledDataError(ValueError):
    pass


def read_labelled(path: Path, kind: str, text_column: str, label_column: str) -> tuple[list[str], list[str]]:
    """(texts, labels) of a JSON-lines or CSV file; labels as strings, whatever their type there."""
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
