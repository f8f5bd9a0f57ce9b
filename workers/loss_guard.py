"""The loss guard: notices a run diverging, so the job rolls back instead of training on.

Large runs spike: PaLM restarted ~100 steps before each of ~20 spikes and skipped the batches that
caused them; OPT-175B's logbook records dozens of such restarts by hand. The guard does what they
did. It watches each step's reported train_loss and grad_norm (the same numbers on every process:
the loss is all-reduced, the norm is the whole model's, so every process decides alike with no
extra collective). A step is a spike step when its loss is above `spike_factor` × the median of
the last `window` steps' losses (a median, so one earlier spike doesn't raise the bar) and at least
`min_increase` above it (a classifier's loss near zero triples by noise alone); `spike_steps`
of them in a row make a spike, and a non-finite loss or gradient norm is one at once (its update has
already poisoned the weights). Before `window` steps no spike is called (the first losses fall fast);
the built-in loop keeps the window in its checkpoints, so a resumed run (after a rollback, a
preemption, a lost host) is guarded from its first step on, against the losses before the checkpoint.

On a spike the loop stops without a checkpoint (its state is suspect) and reports the steps
involved (SpikeEvent); the service resumes the job from its last checkpoint before the spike's
first step, past the batches of every step up to its last (workers/training/elastic.py:
skip_steps), as a new attempt.

A loop that isn't ours (a `script`, a `custom` loop) is watched by its worker instead, from the
metrics it logs (LoggedLossWatch): on a spike the worker kills it (no suspect save) and the job goes
on from the last checkpoint it had written before the spike began, through its own resume. A
script's checkpoints are numbered its own way (an epoch, a count of saves), so which ones came
before is told by the order it wrote them in, not by their steps, and skipping the data is its own
to do. A custom loop's checkpoints and metrics share its context's steps: it rolls back as the
built-in loop does, and its context says how many steps' batches to skip (CustomContext.skip_steps).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from api_schemas.jobs import GuardConfig


@dataclass(frozen=True)
class Spike:
    first_step: int
    last_step: int
    reason: str


class LossGuard:
    def __init__(self, config: GuardConfig, metric: str = "train_loss", recent: list[float] = ()):
        """`recent`: the losses of the steps before this run's first (a checkpoint's), oldest first."""
        self.config, self.metric = config, metric  # the name the reasons give the loss
        self.recent: deque[float] = deque(recent, maxlen=config.window)
        self.spike_started: int | None = None  # the first step of the spike steps in a row so far

    def observe(self, step: int, loss: float, grad_norm: float | None = None) -> Spike | None:
        """A step's numbers, in step order; the spike they complete, if they do."""
        if not self.config.enabled:
            return None
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            what = f"{self.metric} {loss}" if not math.isfinite(loss) else f"grad_norm {grad_norm}"
            return Spike(self.spike_started or step, step, f"{what} at step {step}")
        if len(self.recent) < self.config.window:
            self.recent.append(loss)
            return None
        median = statistics.median(self.recent)
        if loss <= self.config.spike_factor * median or loss - median < self.config.min_increase:
            self.spike_started = None
            self.recent.append(loss)
            return None
        # A spike step: kept out of the median, which stays the run's before the spike.
        self.spike_started = self.spike_started or step
        if step - self.spike_started + 1 < self.config.spike_steps:
            return None
        return Spike(
            self.spike_started, step,
            f"{self.metric} above {self.config.spike_factor:g} × its median of the last {self.config.window} steps ({median:.4g}) "
            f"for {step - self.spike_started + 1} step{'s' if step > self.spike_started else ''}, {loss:.4g} at step {step}",
        )


class LoggedLossWatch:
    """The guard for a loop that isn't ours, fed its events in the order it wrote them."""

    LOSS_NAMES = ("train_loss", "loss")  # what a loop's loss is logged as, unless `metric` says

    def __init__(self, config: GuardConfig):
        self.config, self.metric = config, config.metric
        self.guard: LossGuard | None = None  # once the loss's name is known
        self.written = 0  # events seen so far: each one's number tells the order
        self.checkpoints: list[tuple[int, str]] = []  # (its event's number, its folder in the store)
        self.losses: deque[tuple[int, int]] = deque(maxlen=config.spike_steps + 1)  # (step, its event's number) of the spike so far
        self.spike: Spike | None = None
        self.dropped: list[str] = []  # once it spiked: the folders of the checkpoints written since the spike began

    def checkpoint(self, folder: str) -> None:
        self.written += 1
        self.checkpoints.append((self.written, folder))
        if self.spike is not None:  # written after the spike was seen (the loop runs on until it is stopped)
            self.dropped.append(folder)

    def metrics(self, step: int, values: dict[str, float]) -> Spike | None:
        """A step's logged values; the spike they complete, once (then `dropped` says what to drop)."""
        self.written += 1
        if not self.config.enabled or self.spike is not None:
            return None
        if self.metric is None:
            self.metric = next((name for name in self.LOSS_NAMES if name in values), None)
        if self.metric not in values:
            return None
        self.guard = self.guard or LossGuard(self.config, self.metric)
        self.losses.append((step, self.written))
        if (spike := self.guard.observe(step, values[self.metric])) is None:
            return None
        began = next((number for logged, number in self.losses if logged == spike.first_step), self.losses[0][1])
        self.spike, self.dropped = spike, [folder for number, folder in self.checkpoints if number >= began]
        return spike
