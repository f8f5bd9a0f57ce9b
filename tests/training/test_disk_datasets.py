"""`hf_disk` datasets: a `datasets.save_to_disk` directory trains exactly as the same rows in a JSON-lines
or text file would, and one the model can't use fails naming the field."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.helpers import classifier_spec, job_spec, write_labelled_jsonl
from tests.training.support import run_training, write_corpus
from workers.training import SpecError, load_labelled_corpus

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

STEPS = 4


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_classifier_trains_on_a_saved_dataset_dict_exactly_as_on_the_same_rows_in_jsonl(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    write_labelled_jsonl(root / "labels.jsonl")
    rows = rows_of(root / "labels.jsonl")
    # Labels as a ClassLabel (stored as ints) whose names are the JSON file's labels; and a second split.
    features = datasets.Features({"sentence": datasets.Value("string"), "y": datasets.ClassLabel(names=["first", "second", "third"])})
    train = datasets.Dataset.from_dict({"sentence": [r["text"] for r in rows], "y": [r["label"] for r in rows]}, features=features)
    datasets.DatasetDict({"train": train, "test": train.select(range(10))}).save_to_disk(str(root / "saved"))

    overrides = {"training.max_steps": STEPS, "training.eval_every": STEPS, "checkpoint.every_steps": STEPS}
    from_jsonl = run_training(job_spec(**classifier_spec(**overrides)), root, tmp_path / "jsonl")
    disk_dataset = {"kind": "hf_disk", "path": "saved", "split": "train", "text_column": "sentence", "label_column": "y", "val_fraction": 0.2}
    from_disk = run_training(job_spec(**classifier_spec(dataset=disk_dataset, **overrides)), root, tmp_path / "disk")

    assert from_disk.series("train_loss") == from_jsonl.series("train_loss")
    assert from_disk.series("eval_accuracy") == from_jsonl.series("eval_accuracy")
    a, b = from_disk.final_weights(), from_jsonl.final_weights()
    assert all(torch.equal(a[name], b[name]) for name in b)
    assert json.loads((from_disk.checkpoints[STEPS] / "labels.json").read_text()) == ["first", "second", "third"]


def test_a_language_model_trains_on_a_saved_dataset_as_on_its_texts_joined_by_newlines(tmp_path):
    root = tmp_path / "data"
    name = write_corpus(root, 6_000)
    lines = (root / name).read_text().split("\n")
    datasets.Dataset.from_dict({"text": lines, "label": [0] * len(lines)}).save_to_disk(str(root / "lines"))
    # Empty lines can't be rows (a row needs a text), so the reference file has none either.
    kept = [line for line in lines if line]
    (root / "kept.txt").write_text("\n".join(kept))
    datasets.Dataset.from_dict({"text": kept}).save_to_disk(str(root / "kept"))

    overrides = {"training.max_steps": STEPS, "training.eval_every": STEPS, "checkpoint.every_steps": None}
    from_text = run_training(job_spec(**{"dataset.path": "kept.txt", **overrides}), root, tmp_path / "text")
    from_disk = run_training(
        job_spec(**{"dataset": {"kind": "hf_disk", "path": "kept"}, **overrides}), root, tmp_path / "disk"
    )
    assert from_disk.series("train_loss") == from_text.series("train_loss")
    assert from_disk.series("eval_loss") == from_text.series("eval_loss")

    with pytest.raises(SpecError, match=f"dataset.path: row {lines.index('') + 1} has no text in 'text'"):
        run_training(job_spec(**{"dataset": {"kind": "hf_disk", "path": "lines"}, **overrides}), root, tmp_path / "x")


@pytest.mark.parametrize(
    "dataset, message",
    [
        ({"text_column": "body"}, "no column 'body' among ['text', 'label']"),
        ({"split": "train"}, "holds a single split, so dataset.split must be null"),
        ({"path": "absent"}, "'absent' is not a directory under the data root"),
        ({"path": "plain"}, "is not a directory written by save_to_disk"),
    ],
)
def test_a_saved_dataset_the_classifier_cannot_use_fails_naming_the_field(tmp_path, dataset, message):
    datasets.Dataset.from_dict({"text": ["abc", "def"], "label": ["a", "b"]}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "plain").mkdir()
    spec = job_spec(**classifier_spec(dataset={"kind": "hf_disk", "path": "saved", **dataset}, **{"model.num_labels": 2}))
    with pytest.raises(SpecError, match=f"dataset.path: .*{re.escape(message)}"):
        load_labelled_corpus(spec.dataset, spec.model, tmp_path)
