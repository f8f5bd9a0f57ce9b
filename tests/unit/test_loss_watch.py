"""The loss guard for loops the worker watches from outside (workers/loss_guard.py LoggedLossWatch):
a script's or custom loop's logged loss, and which of its checkpoints came before a spike, told by
the order it wrote them in (its checkpoints' steps are its own numbering: epochs, counts of saves)."""

from __future__ import annotations

import math

from api_schemas.jobs import GuardConfig
from workers.loss_guard import LoggedLossWatch

STEADY = GuardConfig(window=5, spike_steps=2, spike_factor=3.0, min_increase=0.5)


def test_a_nan_stops_at_once_and_the_checkpoints_written_after_it_began_are_dropped_whatever_their_steps():
    watch = LoggedLossWatch(STEADY)
    for step in range(1, 31):
        assert watch.metrics(step, {"loss": 2.0, "lr": 0.1}) is None
        if step % 10 == 0:
            watch.checkpoint(f"attempt-1.{step // 10}/epoch_{step // 10}")  # steps 1, 2, 3: below every metric step
    spike = watch.metrics(31, {"loss": math.nan})
    assert (spike.first_step, spike.last_step) == (31, 31) and spike.reason == "loss nan at step 31"
    assert watch.dropped == []
    assert watch.metrics(32, {"loss": math.nan}) is None  # told once
    watch.checkpoint("attempt-1.4/epoch_4")  # written after the NaN, before the loop was stopped: its weights hold it
    assert watch.dropped == ["attempt-1.4/epoch_4"]


def test_a_spike_over_several_steps_drops_the_checkpoints_written_from_its_first_step_on():
    watch = LoggedLossWatch(STEADY)
    for step in range(1, 11):
        watch.metrics(step, {"train_loss": 1.0})
    watch.checkpoint("before")
    assert watch.metrics(11, {"train_loss": 9.0}) is None  # one spike step: not yet a spike
    watch.checkpoint("during")
    spike = watch.metrics(12, {"train_loss": 9.5})
    assert (spike.first_step, spike.last_step) == (11, 12) and spike.reason.startswith("train_loss above 3 ×")
    assert watch.dropped == ["during"]


def test_the_loss_is_found_by_its_usual_names_or_the_one_the_spec_gives_and_a_disabled_guard_sees_nothing():
    assert LoggedLossWatch(STEADY).metrics(1, {"train_loss": math.inf, "loss": 1.0}).reason == "train_loss inf at step 1"
    assert LoggedLossWatch(STEADY).metrics(1, {"accuracy": math.nan}) is None  # no loss logged: nothing to watch
    own = LoggedLossWatch(GuardConfig(metric="gen_loss"))
    assert own.metrics(1, {"loss": math.nan}) is None and own.metrics(2, {"gen_loss": math.nan}).first_step == 2
    assert LoggedLossWatch(GuardConfig(enabled=False)).metrics(1, {"loss": math.nan}) is None
