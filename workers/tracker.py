"""Accelerate's tracker interface, writing to the events file a Trainyard worker tails.

`accelerator.log({"loss": 0.4}, step=12)` becomes `MetricsEvent(step=12, values={"loss": 0.4})`
(api_schemas/worker_protocol.py), written by the built-in training loop's own reporter
(workers/training/reporter.py). Under a Trainyard `script` job the tracker is added to every
Accelerator on the main process (workers/script_hooks.py); it can also be passed by hand:
`Accelerator(log_with=[TrainyardTracker.from_env()])`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from accelerate.tracking import GeneralTracker

from api_schemas.worker_protocol import EVENTS_FILE_ENV
from workers.training.reporter import JsonlReporter


class TrainyardTracker(GeneralTracker):
    name = "trainyard"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, events_file: Path):
        super().__init__()
        self.reporter = JsonlReporter(events_file)
        self.last_step: int | None = None  # the newest step logged: a checkpoint saved now is numbered by it

    @classmethod
    def from_env(cls) -> TrainyardTracker:
        return cls(Path(os.environ[EVENTS_FILE_ENV]))

    @property
    def tracker(self) -> JsonlReporter:
        return self.reporter

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Numbers are metrics (a bool, a string or a NaN is left out); without `step`, the next one."""
        step = step if step is not None else (self.last_step or 0) + 1
        numbers = {
            name: float(value) for name, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        }
        if numbers:
            self.reporter.metrics(int(step), numbers)
        self.last_step = int(step)

    def checkpoint(self, step: int, path: Path) -> None:
        self.reporter.checkpoint(step, path)

    def finish(self) -> None:
        self.reporter.close()
