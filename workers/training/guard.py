"""The loss guard: notices a run diverging, so the job rolls back instead of training on.

Large runs spike: PaLM restarted ~100 steps before each of ~20 spikes and skipped the batches that
caused them; OPT-175B's logbook records dozens of such restarts by hand. The guard does what they
did. It watches each step's reported train_loss and grad_norm (the same numbers on every process:
the loss is all-reduced, the norm is the whole model's, so every process decides alike with no
extra collective). A step is a spike step when its loss is above `spike_factor` × the median of
the last `window` steps' losses (a median, so one earlier spike doesn't raise the bar) and at least
`min_increase` above it (a classifier's loss near zero triples by noise alone); `spike_steps`
of them in a row make a spike, and a non-finite loss or gradient norm is one at once (its update has
already poisoned the weights). Before `window` steps no spike is called (the first losses fall fast).

On a spike the loop stops without a checkpoint (its state is suspect) and reports the steps
involved (SpikeEvent); the service resumes the job from its last checkpoint before the spike's
first step, past the batches of every step up to its last (workers/training/elastic.py:
skip_steps), as a new attempt.
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
    def __init__(self, config: GuardConfig):
        self.config = config
        self.recent: deque[float] = deque(maxlen=config.window)
        self.spike_started: int | None = None  # the first step of the spike steps in a row so far

    def observe(self, step: int, loss: float, grad_norm: float | None = None) -> Spike | None:
        """A step's numbers, in step order; the spike they complete, if they do."""
        if not self.config.enabled:
            return None
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            what = f"train_loss {loss}" if not math.isfinite(loss) else f"grad_norm {grad_norm}"
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
            f"train_loss above {self.config.spike_factor:g} × its median of the last {self.config.window} steps ({median:.4g}) "
            f"for {step - self.spike_started + 1} step{'s' if step > self.spike_started else ''}, {loss:.4g} at step {step}",
        )
