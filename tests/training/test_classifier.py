"""The `mlp` classifier on labelled texts: it learns, its eval accuracy is gathered over every
process (the same with 1 and 2), and its checkpoint reloads into a model that scores the same."""

from __future__ import annotations

import json
import subprocess

import pytest

from api_schemas.manifest import MODEL_FILE, checkpoint_name
from tests.helpers import classifier_spec, job_spec
from tests.training.support import REPO, read_events, run_training, subprocess_env
from workers.launch import launch_command
from workers.supervisor import free_port
from workers.training import MLPClassifier, eval_dataloader, evaluate_metrics, load_labelled_corpus, load_model_from_checkpoint

STEPS = 60


def test_a_classifier_learns_and_its_checkpoint_scores_the_same_when_reloaded(labelled_root, tmp_path):
    overrides = {"training.max_steps": STEPS, "training.eval_every": 20, "checkpoint.every_steps": STEPS, "optimizer.lr": 0.01,
                 "checkpoint.keep_last": 1, "checkpoint.keep_best": True, "checkpoint.best_metric": "eval_accuracy", "checkpoint.best_mode": "max"}
    spec = job_spec(**classifier_spec(**overrides))
    run = run_training(spec, labelled_root, tmp_path / "run")
    accuracy = run.series("eval_accuracy")
    assert len(accuracy) == 3 and accuracy[-1] >= 0.9 and run.series("eval_loss")[-1] < run.series("eval_loss")[0]

    # keep_best by the highest eval_accuracy: saved at each evaluation that beat it, kept past keep_last.
    improving = [step for i, step in enumerate((20, 40, 60)) if accuracy[i] > max(accuracy[:i], default=-1)]
    assert sorted(run.checkpoints) == sorted({*improving, STEPS})
    best = improving[-1]
    assert json.loads((run.checkpoints[best] / "trainer_state.json").read_text())["best_value"] == max(accuracy)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == sorted({checkpoint_name(best), checkpoint_name(STEPS)})

    checkpoint = run.checkpoints[STEPS]
    assert json.loads((checkpoint / "labels.json").read_text()) == ["first", "second", "third"]
    model, _, loaded_spec = load_model_from_checkpoint(checkpoint)
    assert isinstance(model, MLPClassifier) and (checkpoint / MODEL_FILE).exists()
    corpus = load_labelled_corpus(loaded_spec.dataset, loaded_spec.model, labelled_root)
    metrics = evaluate_metrics(model, eval_dataloader(corpus.val, loaded_spec, whole=True))  # the last step's: the whole split
    assert metrics == pytest.approx({"eval_loss": run.steps[STEPS]["eval_loss"], "eval_accuracy": accuracy[-1]}, abs=1e-5)


def test_eval_accuracy_is_the_same_on_one_process_and_on_two(labelled_root, tmp_path):
    # eval_batches null: the whole validation split, which two processes of 4 don't divide evenly.
    overrides = {"training.max_steps": 20, "training.eval_every": 10, "checkpoint.every_steps": 20, "training.eval_batches": None}
    one = run_training(job_spec(**classifier_spec(**overrides, **{"training.micro_batch_size": 8})), labelled_root, tmp_path / "one")

    two_spec = job_spec(**classifier_spec(**overrides, **{"training.micro_batch_size": 4, "resources.processes_per_node": 2}))
    run_dir, events = tmp_path / "two", tmp_path / "events.jsonl"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(two_spec.model_dump_json())
    done = subprocess.run(
        launch_command(two_spec, run_dir, labelled_root, None, f"127.0.0.1:{free_port()}"), cwd=REPO, env=subprocess_env(events),
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    two = {e["step"]: e["values"] for e in read_events(events) if e["type"] == "metrics"}
    for step in (10, 20):
        # gather_for_metrics: every validation example counted once, whichever process scored it.
        assert two[step]["eval_accuracy"] == one.steps[step]["eval_accuracy"]
        assert two[step]["eval_loss"] == pytest.approx(one.steps[step]["eval_loss"], rel=1e-5)
    assert [two[s]["train_loss"] for s in range(1, 21)] == pytest.approx(one.series("train_loss"), rel=1e-5)
