"""How the training loop reports, without knowing who listens.

Under a Trainyard worker, events go to a JSONL file the worker tails and forwards to the service
(`TRAINYARD_EVENTS_FILE`); under a plain `accelerate launch`, they are printed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Protocol

from api_schemas.worker_protocol import EVENTS_FILE_ENV, CheckpointEvent, InvalidSpecEvent, MetricsEvent, SpikeEvent, encode_event


class Reporter(Protocol):
    # True when whoever listens takes each reported checkpoint directory over (the worker copies it
    # to the artifact store, then deletes it); else the loop keeps only `checkpoint.keep_last`.
    takes_checkpoints: bool

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def checkpoint(self, step: int, path: Path) -> None: ...

    def invalid_spec(self, message: str) -> None: ...

    def spike(self, first_step: int, last_step: int, reason: str) -> None: ...

    def close(self) -> None: ...


class JsonlReporter:
    """The worker's events file: one event per line, flushed per line so the worker sees each step as it ends.

    With `progress_every_s` (the built-in loops; a script prints its own), a line of progress goes
    to stdout too, which is the job's log: at each evaluation and at least every that many seconds,
    so someone reading the logs sees the job move."""

    takes_checkpoints = True

    def __init__(self, path: Path, progress_every_s: float | None = None):
        self._file = open(path, "a", encoding="utf-8")
        self.progress_every_s = progress_every_s
        self._last_progress = time.monotonic()

    def _write(self, event: MetricsEvent | CheckpointEvent | InvalidSpecEvent | SpikeEvent) -> None:
        self._file.write(encode_event(event))
        self._file.flush()

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self._write(MetricsEvent(step=step, values=values))
        if self.progress_every_s is None:
            return
        now = time.monotonic()
        if "eval_loss" in values or now - self._last_progress >= self.progress_every_s:
            print(progress_line(step, values), flush=True)
            self._last_progress = now

    def checkpoint(self, step: int, path: Path) -> None:
        self._write(CheckpointEvent(step=step, path=path.resolve()))

    def invalid_spec(self, message: str) -> None:
        self._write(InvalidSpecEvent(message=message))

    def spike(self, first_step: int, last_step: int, reason: str) -> None:
        self._write(SpikeEvent(first_step=first_step, last_step=last_step, reason=reason))
        print(f"loss guard: {reason}; stopping, to go on from the checkpoint before step {first_step} (while rollbacks are left)", flush=True)

    def close(self) -> None:
        self._file.close()


# What a progress line shows of the built-in loop's metrics; a custom job's own names are all shown.
PROGRESS_METRICS = ("train_loss", "eval_loss", "eval_accuracy", "tokens_per_s")


def progress_line(step: int, values: dict[str, float]) -> str:
    """`step 250: train_loss=2.451 eval_loss=2.502 tokens/s=12,345`"""
    shown = {name: values[name] for name in PROGRESS_METRICS if name in values} or values
    parts = [f"tokens/s={value:,.0f}" if name == "tokens_per_s" else f"{name}={value:.4g}" for name, value in shown.items()]
    return f"step {step}: " + " ".join(parts)


class ConsoleReporter:
    takes_checkpoints = False

    def __init__(self, every: int = 10):
        self.every = every

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if step % self.every == 0 or "eval_loss" in values:
            print(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()), flush=True)

    def checkpoint(self, step: int, path: Path) -> None:
        print(f"step {step}: checkpoint saved to {path}", flush=True)

    def invalid_spec(self, message: str) -> None:
        pass  # bad_spec prints it

    def spike(self, first_step: int, last_step: int, reason: str) -> None:
        print(f"loss guard: {reason} (steps {first_step}-{last_step}); stopping", flush=True)

    def close(self) -> None:
        pass


def reporter_from_env() -> Reporter:
    path = os.environ.get(EVENTS_FILE_ENV)
    return JsonlReporter(Path(path), progress_every_s=10.0) if path else ConsoleReporter()
