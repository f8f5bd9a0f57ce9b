"""Training correctness, proved by equivalence with a reference computation.

Each test trains tiny GPTs on CPU in fp32 and compares the saved weights or the reported metrics
of two ways of running that must agree: accumulation vs a larger batch, resume vs straight
through, two processes vs one, the reported lr vs its closed form.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed
from safetensors.torch import load_file

from api_schemas import JobSpec
from api_schemas.manifest import MODEL_FILE, verify_manifest
from tests.helpers import tiny_spec
from workers.supervisor import free_port, launch_command
from workers.training import GPT, eval_dataloader, evaluate, load_model, load_text_corpus, lr_at, train


class Recorder:
    """A Reporter that keeps what it is told."""

    def __init__(self):
        self.steps: dict[int, dict[str, float]] = {}
        self.checkpoints: dict[int, Path] = {}

    def metrics(self, step, values):
        self.steps[step] = values

    def checkpoint(self, step, path):
        self.checkpoints[step] = path

    def close(self):
        pass


def run(spec: dict, data_root: Path, run_dir: Path, resume_from: Path | None = None) -> Recorder:
    recorder = Recorder()
    try:
        train(JobSpec.model_validate(spec), data_root, run_dir, recorder, resume_from)
    finally:
        # Accelerate keeps process-wide singletons; each run here is a fresh "process".
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return recorder


def weights(recorder: Recorder) -> dict[str, torch.Tensor]:
    return load_file(str(recorder.checkpoints[max(recorder.checkpoints)] / MODEL_FILE))


def test_accumulating_4_micro_batches_of_8_equals_one_batch_of_32(data_root, tmp_path):
    accumulated = run(tiny_spec(**{"training.micro_batch_size": 8, "training.gradient_accumulation_steps": 4, "training.max_steps": 3}), data_root, tmp_path / "a")
    single = run(tiny_spec(**{"training.micro_batch_size": 32, "training.gradient_accumulation_steps": 1, "training.max_steps": 3}), data_root, tmp_path / "b")
    assert sorted(accumulated.steps) == [1, 2, 3]  # steps count optimizer steps, not micro-batches
    assert [m["lr"] for m in accumulated.steps.values()] == [m["lr"] for m in single.steps.values()]
    a, b = weights(accumulated), weights(single)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    for step in (1, 2, 3):
        assert accumulated.steps[step]["train_loss"] == pytest.approx(single.steps[step]["train_loss"], rel=1e-5)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_stopping_halfway_and_resuming_is_bit_identical_to_running_straight_through(tmp_path, accumulation):
    # A corpus so small that an epoch is 14 micro-batches, so the run crosses epoch boundaries
    # (after the resume point without accumulation, before it with), with dropout on.
    data_root = tmp_path / "data"
    data_root.mkdir()
    (data_root / "small.txt").write_text((Path(__file__).parents[2] / "data" / "tinyshakespeare.txt").read_text()[:1000])
    spec = tiny_spec(**{
        "dataset.path": "small.txt", "training.max_steps": 16, "training.gradient_accumulation_steps": accumulation,
        "training.eval_every": 4, "checkpoint.every_steps": 8, "checkpoint.keep_last": 5, "model.dropout": 0.1,
    })
    straight = run(spec, data_root, tmp_path / "straight")
    state = json.loads((straight.checkpoints[8] / "trainer_state.json").read_text())
    assert state["epoch"] >= 1 or accumulation == 1  # the checkpoint sits past an epoch boundary
    resumed = run(spec, data_root, tmp_path / "resumed", resume_from=straight.checkpoints[8])

    assert sorted(resumed.steps) == list(range(9, 17))
    assert [resumed.steps[s]["train_loss"] for s in range(9, 17)] == [straight.steps[s]["train_loss"] for s in range(9, 17)]
    a, b = weights(resumed), weights(straight)
    assert all(torch.equal(a[name], b[name]) for name in b)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_reported_lr_follows_the_closed_form_schedule(data_root, tmp_path, schedule):
    spec = tiny_spec(**{"schedule.name": schedule, "schedule.warmup_steps": 3, "schedule.min_lr": 1e-4, "training.max_steps": 12})
    recorder = run(spec, data_root, tmp_path / "run")
    parsed = JobSpec.model_validate(spec)
    assert [recorder.steps[s]["lr"] for s in range(1, 13)] == pytest.approx([lr_at(s - 1, parsed) for s in range(1, 13)], rel=1e-12)
    # Warmup starts at lr/(warmup+1); decaying schedules end near min_lr.
    assert recorder.steps[1]["lr"] == pytest.approx(1e-3 / 4)
    if schedule != "constant":
        assert recorder.steps[12]["lr"] <= 2e-4 + 1e-12


def test_checkpoint_is_complete_verified_and_reproduces_the_reported_eval_loss(data_root, tmp_path):
    spec = tiny_spec(**{"training.max_steps": 6, "checkpoint.every_steps": 2, "checkpoint.keep_last": 2, "training.eval_every": 3})
    recorder = run(spec, data_root, tmp_path / "run")
    final = recorder.checkpoints[6]
    assert {p.name for p in final.iterdir()} == {MODEL_FILE, "state", "trainer_state.json", "spec.json", "tokenizer.json", "manifest.json"}
    verify_manifest(final)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]  # keep_last

    parsed = JobSpec.model_validate(spec)
    corpus = load_text_corpus(parsed.dataset, data_root)
    model = load_model(parsed, corpus.tokenizer.vocab_size, final / MODEL_FILE)
    assert not any("_orig_mod" in name for name in load_file(str(final / MODEL_FILE)))
    assert evaluate(model, eval_dataloader(corpus.val, parsed)) == pytest.approx(recorder.steps[6]["eval_loss"], abs=1e-4)


def test_grad_norm_is_measured_before_clipping(data_root, tmp_path):
    clipped = run(tiny_spec(**{"training.grad_clip_norm": 1e-3, "training.max_steps": 3}), data_root, tmp_path / "a")
    assert clipped.steps[1]["grad_norm"] > 1e-2  # the pre-clip norm, far above the limit


def test_grad_clip_value_bounds_every_gradient_element(data_root, tmp_path):
    # Plain SGD for one step at a constant lr: each parameter moves by lr × its (clamped) gradient.
    spec = tiny_spec(**{
        "optimizer.name": "sgd", "optimizer.lr": 0.1, "optimizer.weight_decay": 0.0, "schedule.name": "constant",
        "schedule.warmup_steps": 0, "training.grad_clip_norm": None, "training.grad_clip_value": 1e-4, "training.max_steps": 1,
    })
    parsed = JobSpec.model_validate(spec)
    set_seed(parsed.training.seed)  # the loop builds its model right after the same call
    initial = GPT(parsed.model, load_text_corpus(parsed.dataset, data_root).tokenizer.vocab_size).state_dict()
    recorder = run(spec, data_root, tmp_path / "run")
    moved = max((weights(recorder)[name] - initial[name]).abs().max().item() for name in initial)
    # Unclamped, the largest move would be ~lr × |grad| ≈ 1e-2; clamped it is lr × 1e-4, give or
    # take a float32 ulp of the largest weights (LayerNorm's, near 1.0: 1.2e-7).
    assert 0 < moved <= 0.1 * 1e-4 + 2.4e-7
    assert recorder.steps[1]["grad_norm"] > 1e-3  # reported before clamping


def test_two_processes_of_6_train_like_one_process_of_12(data_root, tmp_path):
    base = {"training.max_steps": 4, "training.eval_every": 4, "checkpoint.every_steps": None}
    single = run(tiny_spec(**{**base, "training.micro_batch_size": 12}), data_root, tmp_path / "one")

    # The real launch command the worker uses, with gloo on two CPU processes.
    spec = JobSpec.model_validate(tiny_spec(**{**base, "training.micro_batch_size": 6, "resources.processes_per_node": 2}))
    run_dir = tmp_path / "two"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(spec.model_dump_json())
    events = run_dir / "events.jsonl"
    done = subprocess.run(
        launch_command(spec, run_dir, data_root, None, free_port()),
        check=False, cwd=Path(__file__).parents[2], capture_output=True, text=True, env={**os.environ, "TRAINYARD_EVENTS_FILE": str(events)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    two_losses = [e["values"]["train_loss"] for e in lines if e["type"] == "metrics"]
    assert two_losses == pytest.approx([single.steps[s]["train_loss"] for s in range(1, 5)], rel=1e-5)
    final = Path([e for e in lines if e["type"] == "checkpoint"][-1]["path"])
    two, one = load_file(str(final / MODEL_FILE)), weights(single)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
