"""`python -m workers.training`: JSONL events under TRAINYARD_EVENTS_FILE, exit 2 with one line (and an
`invalid_spec` event, for what only the training can find) on a spec that cannot run."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from api_schemas.manifest import checkpoint_name, verify_manifest
from tests.helpers import job_spec, tiny_spec
from tests.training.support import REPO, entry_point, read_events, run_training, subprocess_env, write_corpus

STEPS = 4


def run_entry_point(tmp_path, data_root, overrides: dict) -> tuple[subprocess.CompletedProcess, object]:
    """`python -m workers.training` on a tiny spec with `overrides`, events going to a file."""
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(tiny_spec(**overrides)))
    events_file = tmp_path / "events.jsonl"
    done = subprocess.run(
        entry_point(spec_file, data_root, tmp_path / "run"), cwd=REPO, env=subprocess_env(events_file),
        capture_output=True, text=True, timeout=300,
    )
    return done, events_file


def test_entry_point_writes_one_metrics_event_per_step_and_checkpoint_events_for_verified_directories(data_root, tmp_path):
    overrides = {"training.max_steps": STEPS, "training.eval_every": 2, "checkpoint.every_steps": 2, "checkpoint.keep_last": 2}
    done, events_file = run_entry_point(tmp_path, data_root, overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    events = read_events(events_file)

    metrics = [e for e in events if e["type"] == "metrics"]
    assert [e["step"] for e in metrics] == [1, 2, 3, 4]
    for event in metrics:
        assert {"train_loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"} <= set(event["values"])
        assert all(math.isfinite(v) for v in event["values"].values())
    assert [e["step"] for e in metrics if "eval_loss" in e["values"]] == [2, 4]

    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    assert [e["step"] for e in checkpoints] == [2, 4]
    for event in checkpoints:
        path = Path(event["path"])
        assert path.is_absolute() and path.name == checkpoint_name(event["step"])
        assert verify_manifest(path)["step"] == event["step"]
    # Every metrics event of a step comes before that step's checkpoint event.
    order = [(e["type"], e["step"]) for e in events]
    assert order.index(("metrics", 4)) < order.index(("checkpoint", 4))

    # The same training as an in-process train() call (same thread count, same samples).
    in_process = run_training(job_spec(**overrides), data_root, tmp_path / "in-process")
    assert [e["values"]["train_loss"] for e in metrics] == pytest.approx(in_process.series("train_loss"), rel=1e-6)
    eval_losses = [e["values"]["eval_loss"] for e in metrics if "eval_loss" in e["values"]]
    assert eval_losses == pytest.approx(in_process.series("eval_loss"), rel=1e-6)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"training.max_steps": 0}, "training.max_steps"),
        ({"optimizer.lr_typo": 0.1}, "optimizer.lr_typo"),
        ({"training.max_steps": 5, "schedule.warmup_steps": 5}, "schedule.warmup_steps"),  # a cross-field rule
        ({"dataset.path": "absent.txt"}, "dataset.path"),  # valid JSON, but no such corpus
        ({"dataset.path": "short.txt", "model.block_size": 4096}, "model.block_size"),  # longer than the corpus
    ],
    ids=["out-of-range", "unknown-field", "cross-field", "missing-corpus", "window-longer-than-corpus"],
)
def test_a_spec_that_cannot_run_exits_2_with_one_line_naming_the_field(data_root, tmp_path, overrides, field):
    write_corpus(data_root, chars=2_000, name="short.txt")
    done, events_file = run_entry_point(tmp_path, data_root, overrides)
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(done.stderr.strip().splitlines()) == 1 and field in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    # No step, no checkpoint. What only the training could find (the corpus) it also tells the worker, which then
    # fails the job without retrying it; a spec the schema refuses never got past submit.
    events = read_events(events_file)
    assert all(event["type"] == "invalid_spec" and field in event["message"] for event in events), events
    assert len(events) == (1 if overrides.get("dataset.path") else 0), events
