"""Two gloo processes on CPU, micro-batch 6 each, train like one process with micro-batch 12."""

from __future__ import annotations

import subprocess

import pytest
import torch
from safetensors.torch import load_file

from api_schemas.manifest import MODEL_FILE
from tests.helpers import job_spec
from tests.training.support import REPO, read_events, run_training, subprocess_env, write_corpus
from workers.launch import launch_command
from workers.supervisor import free_port
from workers.training import eval_dataloader, evaluate, load_model, load_text_corpus

STEPS = 4
# Measured after 4 steps: train losses and lr bit-equal, weights at most 2.6e-8 apart (abs; the
# all-reduce averages two half-batch gradients where one process takes one mean). Tolerance ~40x that.
RTOL, ATOL = 1e-5, 1e-6


def overrides(micro_batch: int, processes: int) -> dict:
    return {
        "training.micro_batch_size": micro_batch, "resources.processes_per_node": processes, "training.max_steps": STEPS,
        "training.eval_every": 2, "checkpoint.every_steps": 2, "checkpoint.keep_last": 2,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiprocess")
    data_root = root / "data"
    name = write_corpus(data_root)
    two_spec = job_spec(**{"dataset.path": name, **overrides(6, 2)})
    run_dir = root / "two"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(two_spec.model_dump_json())
    events = root / "events.jsonl"
    done = subprocess.run(
        # The worker's own launch command, as it runs a 2-process CPU job (gloo).
        launch_command(two_spec, run_dir, data_root, None, f"127.0.0.1:{free_port()}"), cwd=REPO, env=subprocess_env(events),
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    two = read_events(events)

    one_spec = job_spec(**{"dataset.path": name, **overrides(12, 1)})
    one = run_training(one_spec, data_root, root / "one")
    return two_spec, data_root, two, one


def two_metrics(events):
    return {e["step"]: e["values"] for e in events if e["type"] == "metrics"}


def two_checkpoints(events):
    return {e["step"]: e["path"] for e in events if e["type"] == "checkpoint"}


def test_two_processes_of_6_train_like_one_process_of_12(runs):
    _, _, two, one = runs
    metrics = two_metrics(two)
    assert sorted(metrics) == [1, 2, 3, 4]  # reported once, by the main process
    assert [metrics[s]["lr"] for s in range(1, STEPS + 1)] == one.series("lr")
    assert [metrics[s]["train_loss"] for s in range(1, STEPS + 1)] == pytest.approx(one.series("train_loss"), rel=1e-6)
    assert [metrics[s]["grad_norm"] for s in range(1, STEPS + 1)] == pytest.approx(one.series("grad_norm"), rel=1e-5)

    a = load_file(str(two_checkpoints(two)[STEPS] + "/" + MODEL_FILE))
    b = one.final_weights()
    assert a.keys() == b.keys()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("step", [2, STEPS])
def test_the_eval_loss_of_two_processes_is_the_one_process_eval_loss_of_the_same_weights(runs, step):
    spec, data_root, two, _ = runs
    corpus = load_text_corpus(spec.dataset, data_root)
    model = load_model(spec, corpus.tokenizer.vocab_size, two_checkpoints(two)[step] + "/" + MODEL_FILE)
    assert evaluate(model, eval_dataloader(corpus.val, spec, whole=step == STEPS)) == pytest.approx(two_metrics(two)[step]["eval_loss"], abs=1e-5)


@pytest.mark.parametrize("step", [2, STEPS])
def test_two_processes_of_6_report_the_eval_loss_of_one_process_of_12(runs, step):
    _, _, two, one = runs
    assert two_metrics(two)[step]["eval_loss"] == pytest.approx(one.steps[step]["eval_loss"], abs=1e-5)
