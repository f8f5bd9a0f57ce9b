"""How the training loop reports, without knowing who listens.

Under a Trainyard worker, events go to a JSONL file the worker tails and forwards to the service
(`TRAINYARD_EVENTS_FILE`); under a plain `accelerate launch`, they are printed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from api_schemas.worker_protocol import EVENTS_FILE_ENV, CheckpointEvent, MetricsEvent, encode_event


class Reporter(Protocol):
    # True when whoever listens takes each reported checkpoint directory over (the worker copies it
    # to the artifact store, then deletes it); else the loop keeps only `checkpoint.keep_last`.
    takes_checkpoints: bool

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def checkpoint(self, step: int, path: Path) -> None: ...

    def close(self) -> None: ...


class JsonlReporter:
    """The worker's events file: one event per line, flushed per line so the worker sees each step as it ends."""

    takes_checkpoints = True

    def __init__(self, path: Path):
        self._file = open(path, "a", encoding="utf-8")

    def _write(self, event: MetricsEvent | CheckpointEvent) -> None:
        self._file.write(encode_event(event))
        self._file.flush()

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self._write(MetricsEvent(step=step, values=values))

    def checkpoint(self, step: int, path: Path) -> None:
        self._write(CheckpointEvent(step=step, path=path.resolve()))

    def close(self) -> None:
        self._file.close()


class ConsoleReporter:
    takes_checkpoints = False

    def __init__(self, every: int = 10):
        self.every = every

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if step % self.every == 0 or "eval_loss" in values:
            print(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()), flush=True)

    def checkpoint(self, step: int, path: Path) -> None:
        print(f"step {step}: checkpoint saved to {path}", flush=True)

    def close(self) -> None:
        pass


def reporter_from_env() -> Reporter:
    path = os.environ.get(EVENTS_FILE_ENV)
    return JsonlReporter(Path(path)) if path else ConsoleReporter()
