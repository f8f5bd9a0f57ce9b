"""Accelerate's tracker interface, writing to the events file a Trainyard worker tails.

`accelerator.log({"loss": 0.4}, step=12)` becomes `MetricsEvent(step=12, values={"loss": 0.4})`
(api_schemas/worker_protocol.py), written by the built-in training loop's own reporter
(workers/training/reporter.py). Under a Trainyard `script` job the tracker is added to every
Accelerator on the main process (workers/script_hooks.py); it can also be passed by hand:
`Accelerator(log_with=[TrainyardTracker.from_env()])`.
"""

from __future__ import annotations

import os
import sys
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
        self.last_step: int | None = None  # the newest step logged
        self.checkpoints_by_step: dict[int, str] = {}  # step -> folder name, of the checkpoints saved so far
        self.warned: set[str] = set()  # metric names already warned about

    @classmethod
    def from_env(cls) -> TrainyardTracker:
        return cls(Path(os.environ[EVENTS_FILE_ENV]))

    @property
    def tracker(self) -> JsonlReporter:
        return self.reporter

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Numbers are metrics (ints, floats, bools, 0-dim tensors and numpy scalars, as floats; a NaN
        or infinity too: the worker's loss guard watches for one); anything else is skipped, with one
        warning per name in the job's logs.
        Without `step`, the next one."""
        step = step if step is not None else (self.last_step or 0) + 1
        numbers = {}
        for name, value in values.items():
            number = as_number(value)
            if number is None:
                if name not in self.warned:
                    self.warned.add(name)
                    print(f"trainyard: metric {name!r} is a {type(value).__name__}, not a number; not recorded", file=sys.stderr, flush=True)
            else:
                numbers[name] = number
        if numbers:
            self.reporter.metrics(int(step), numbers)
        self.last_step = int(step)

    def checkpoint(self, step: int, path: Path) -> None:
        self.reporter.checkpoint(step, path)

    def finish(self) -> None:
        self.reporter.close()


def as_number(value) -> float | None:
    """A metric's value as a float: a number, a bool, or a single-value tensor or array with no
    dimensions (`loss.detach()`, `np.float32(…)`: what `.item()` would give). None for anything else."""
    if isinstance(value, (int, float)):  # bool included
        return float(value)
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        item = value.item()
        if isinstance(item, (int, float)):
            return float(item)
    return None
