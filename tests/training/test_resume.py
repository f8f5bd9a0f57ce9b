"""Exact resume: N/2 steps, a checkpoint, a new process resuming to N is the run that never stopped."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import job_spec
from tests.training.support import micro_batches_per_epoch, run_training, write_corpus

N = 16
HALF = N // 2
PROCESS_MEASUREMENTS = ("step_time_s", "tokens_per_s", "peak_memory_mb")

# (corpus characters, accumulation, micro-batches an epoch, (epoch, batch_in_epoch) of the step-8 checkpoint).
# Small corpora so that epochs are a few steps long; micro-batches of 4 windows of 16 tokens.
CASES = {
    # Resume at batch 8 of 12 in epoch 0; the epoch ends at step 12, after the resume point.
    "mid-epoch": (889, 1, 12, (0, 8)),
    # 6 steps an epoch: resume at batch 4 of epoch 1; the next epoch starts at step 13.
    "accumulation-2-mid-epoch": (889, 2, 12, (1, 4)),
    # 13 micro-batches' worth of windows, trimmed to 12 so no epoch ends in a short accumulation
    # window (see test_accumulation): resume at batch 4 of epoch 1, the next epoch starts at step 13.
    "accumulation-2-trimmed-epoch": (950, 2, 12, (1, 4)),
    # 8 micro-batches: the checkpoint is the last batch of epoch 0, the resumed run starts epoch 1.
    "at-an-epoch-end": (600, 1, 8, (0, 8)),
}


@pytest.mark.parametrize("case", CASES)
def test_resuming_from_the_halfway_checkpoint_is_bit_identical_to_running_straight_through(tmp_path, case):
    chars, accumulation, per_epoch, (epoch, batch) = CASES[case]
    data_root = tmp_path / "data"
    name = write_corpus(data_root, chars)
    spec = job_spec(**{
        "dataset.path": name, "model.dropout": 0.1, "training.max_steps": N,
        "training.gradient_accumulation_steps": accumulation, "training.eval_every": 4,
        "checkpoint.every_steps": HALF, "checkpoint.keep_last": 2,
    })
    assert micro_batches_per_epoch(spec, data_root) == per_epoch

    straight = run_training(spec, data_root, tmp_path / "straight")
    halfway = straight.checkpoints[HALF]
    state = json.loads((halfway / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (HALF, epoch, batch)
    final_state = json.loads((straight.checkpoints[N] / "trainer_state.json").read_text())
    assert final_state["epoch"] > state["epoch"]  # an epoch boundary lies after the resume point

    resumed = run_training(spec, data_root, tmp_path / "resumed", resume_from=halfway)

    assert [step for step, _ in resumed.metrics_log] == list(range(HALF + 1, N + 1))
    for step in range(HALF + 1, N + 1):
        # Every reported value but the measurements of the process, exactly: losses, eval losses,
        # grad norms, lr. Timings and peak memory (the process's resident-set high-water mark on
        # the CPU) depend on what else the process did, so they differ between two runs.
        ours = {k: v for k, v in resumed.steps[step].items() if k not in PROCESS_MEASUREMENTS}
        theirs = {k: v for k, v in straight.steps[step].items() if k not in PROCESS_MEASUREMENTS}
        assert ours == theirs, f"step {step}"
    assert json.loads((resumed.checkpoints[N] / "trainer_state.json").read_text()) == final_state

    a, b = resumed.final_weights(), straight.final_weights()
    assert a.keys() == b.keys()
    assert [name for name in b if not torch.equal(a[name], b[name])] == []
