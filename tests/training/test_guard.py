"""The loss guard (workers/loss_guard.py): a run whose data has a poisoned window of batches
stops at the spike with no checkpoint of it, and resumed from the checkpoint before it past those
batches, ends with the weights of a run on the same data with the window removed up front."""

from __future__ import annotations

import math

import pytest
import torch

from api_schemas.jobs import GuardConfig
from tests.helpers import guarded_classifier_spec, job_spec, write_poisoned_labels
from tests.training.support import run_training
from workers.training.elastic import skipped
from workers.loss_guard import LossGuard

STEPS, EVERY, BATCH = 60, 10, 8
POISONED = range(31, 34)  # the steps whose batches have their labels swapped: three, as many as spike_steps


def spec(path: str):
    return job_spec(**guarded_classifier_spec(path, STEPS, EVERY, BATCH))


def test_a_poisoned_window_is_rolled_back_skipped_and_ends_as_a_run_without_it(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_poisoned_labels(data, POISONED, BATCH)

    # The poisoned run stops at the spike's last step, seen one step late, with no checkpoint past it.
    spiked = run_training(spec("poisoned.jsonl"), data, tmp_path / "spiked")
    [(first, last, reason)] = spiked.spikes
    assert (first, last) == (POISONED.start, POISONED.stop - 1) and "median" in reason, reason
    assert max(spiked.checkpoints) == POISONED.start - 1 and max(step for step, _ in spiked.metrics_log) <= last + 1

    # Resumed from its last checkpoint before the spike, past the spike's batches: 60 steps in all.
    resumed = run_training(spec("poisoned.jsonl"), data, tmp_path / "resumed", resume_from=spiked.checkpoints[first - 1], skip_steps=last - (first - 1))
    assert not resumed.spikes and max(resumed.checkpoints) == STEPS

    # Against a run on the same data with those batches removed up front, the same number of steps.
    reference = run_training(spec("without.jsonl"), data, tmp_path / "reference")
    ours, theirs = resumed.final_weights(), reference.final_weights()
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6)
    losses = dict((step, values["train_loss"]) for step, values in reference.metrics_log)
    assert [values["train_loss"] for step, values in resumed.metrics_log] == pytest.approx([losses[s] for s in range(first, STEPS + 1)], abs=1e-6)


def test_a_spike_soon_after_a_resume_is_caught_against_the_losses_before_the_checkpoint(tmp_path):
    # A second poisoned window 4 steps after where the first rollback resumes: a guard that started
    # empty needed 10 steps of median first, and trained through it (found trying it as a new user).
    data = tmp_path / "data"
    data.mkdir()
    write_poisoned_labels(data, [POISONED, range(37, 40)], BATCH)
    spiked = run_training(spec("poisoned.jsonl"), data, tmp_path / "spiked")
    [(first, last, _)] = spiked.spikes
    resumed = run_training(spec("poisoned.jsonl"), data, tmp_path / "resumed", resume_from=spiked.checkpoints[first - 1], skip_steps=last - (first - 1))
    # Past the 3 skipped steps' batches, steps 34-36 read the rows of 37-39.
    [(again_first, again_last, reason)] = resumed.spikes
    assert (again_first, again_last) == (34, 36) and "median of the last 10 steps" in reason, reason
    assert not resumed.checkpoints  # stopped before its next one (40): none of its suspect state


def test_the_guard_calls_a_spike_after_spike_steps_in_a_row_and_a_nan_at_once():
    guard = LossGuard(GuardConfig(window=5, spike_factor=3.0, spike_steps=2))
    assert [guard.observe(step, 1.0) for step in range(1, 6)] == [None] * 5
    assert guard.observe(6, 3.5) is None and guard.observe(7, 1.2) is None  # one spike step, then back: nothing
    assert guard.observe(8, 4.0) is None
    spike = guard.observe(9, 5.0)
    assert (spike.first_step, spike.last_step) == (8, 9)
    fresh = LossGuard(GuardConfig(window=5))
    assert fresh.observe(1, 2.0, grad_norm=math.inf).reason == "grad_norm inf at step 1"  # before any window: at once
    assert LossGuard(GuardConfig(enabled=False)).observe(1, math.nan) is None
    assert job_spec(**{"training.guard": False}).training.guard == GuardConfig(enabled=False)  # the shorthand


def test_a_skip_moves_the_data_position_on_in_whole_epochs_past_an_epochs_end():
    progress = {"step": 30, "epoch": 0, "batch_in_epoch": 90, "processes": 1}
    # 3 steps of 4 micro-batches from position 90 of a 96-batch epoch: 6 left in epoch 0, then 6 into epoch 1.
    assert skipped(progress, 3, 4, 96) == {"step": 30, "epoch": 1, "batch_in_epoch": 6, "processes": 1}
    assert skipped(progress, 1, 4, 96)["batch_in_epoch"] == 94
