"""A training job's progress: on a terminal a `rich` progress bar redrawn in place; in a log file
(not a TTY) a plain line at a steady cadence: every 10% and at least every `every_s` seconds, and
on every status change.

    running   [#########...............]  750/2000  38%  loss 1.9321  6.1k tok/s  ETA 3m25s
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

if TYPE_CHECKING:
    from api_schemas import JobOut
    from trainyard.client import Client


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{seconds:02d}s"
    return f"{seconds}s"


def format_rate(tokens_per_sec: float) -> str:
    for divisor, suffix in ((1e6, "M"), (1e3, "k")):
        if tokens_per_sec >= divisor:
            return f"{tokens_per_sec / divisor:.1f}{suffix} tok/s"
    return f"{tokens_per_sec:.0f} tok/s"


def steps_text(step: int, max_steps: int | None) -> str:
    """"12/100", or "12" for a job that gave no max_steps (a script may not know)."""
    return f"{step}/{max_steps}" if max_steps else str(step)


def format_details(
    train_loss: float | None = None, tokens_per_sec: float | None = None, eta_seconds: float | None = None, restarts: int = 0
) -> str:
    """What follows the bar: loss, speed, ETA and restarts, those known."""
    parts = []
    if train_loss is not None:
        parts.append(f"loss {train_loss:.4f}")
    if tokens_per_sec is not None:
        parts.append(format_rate(tokens_per_sec))
    if eta_seconds is not None:
        parts.append(f"ETA {format_duration(eta_seconds)}")
    if restarts:
        parts.append(f"restarts {restarts}")
    return "  ".join(parts)


def format_progress(
    step: int,
    max_steps: int | None,
    *,
    status: str | None = None,
    train_loss: float | None = None,
    tokens_per_sec: float | None = None,
    eta_seconds: float | None = None,
    restarts: int = 0,
    width: int = 24,
) -> str:
    """One plain line describing a job's progress; the parts not known yet are left out."""
    if max_steps:
        fraction = min(max(step / max_steps, 0.0), 1.0)
        filled = int(fraction * width)
        parts = [f"[{'#' * filled}{'.' * (width - filled)}]", steps_text(step, max_steps), f"{fraction:4.0%}"]
    else:  # a script that gave no max_steps: no bar to fill
        parts = [f"step {step}"]
    if status is not None:
        parts.insert(0, f"{status:<9}")  # 9 = len("scheduled"), so the bars line up
    details = format_details(train_loss, tokens_per_sec, eta_seconds, restarts)
    return "  ".join(parts + ([details] if details else []))


class StepRate:
    """Steps per second, smoothed: an exponential moving average of the speed between step changes,
    each weighed by how long it lasted (`1 - e^(-dt/tau)`), so the ETA follows the current speed
    without jumping with each poll's luck."""

    def __init__(self, tau: float = 30.0):
        self.tau = tau
        self.last: tuple[float, int] | None = None
        self.rate: float | None = None

    def add(self, now: float, step: int) -> None:
        if self.last is not None and step == self.last[1]:
            return  # only the moments the step changed tell the speed
        if self.last is not None and step < self.last[1]:
            self.last, self.rate = None, None  # a restart resumed from an earlier checkpoint
        if self.last is not None and now > self.last[0]:
            dt = now - self.last[0]
            speed = (step - self.last[1]) / dt
            weight = 1 - math.exp(-dt / self.tau)
            self.rate = speed if self.rate is None else self.rate + weight * (speed - self.rate)
        self.last = (now, step)

    def steps_per_second(self) -> float | None:
        return self.rate


class ProgressBar:
    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic, every_s: float = 10.0):
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.interactive = self.stream.isatty()
        self.clock = clock
        self.rate = StepRate()
        self._bar: Progress | None = None  # the terminal's, started at the first update
        self._printed_decile = -1
        self._printed_status: str | None = None
        self._printed_at = -math.inf

    def update(
        self,
        status: str,
        step: int,
        max_steps: int | None,
        train_loss: float | None = None,
        tokens_per_step: int | None = None,
        restarts: int = 0,
        waiting_reason: str | None = None,
    ) -> None:
        """`waiting_reason`: why a queued job waits, shown instead of its (empty) speed and loss."""
        now = self.clock()
        if status == "running" and step > 0:  # the time spent queued and starting up is no training speed
            self.rate.add(now, step)
        speed = self.rate.steps_per_second()
        tokens_per_sec = speed * tokens_per_step if speed and tokens_per_step else None
        eta_seconds = (max_steps - step) / speed if speed and max_steps and status == "running" else None
        if self.interactive:
            details = waiting_reason or format_details(train_loss, tokens_per_sec, eta_seconds, restarts)
            self._draw(status, step, max_steps, details)
            return
        decile = int(10 * step / max_steps) if max_steps else 0
        if decile > self._printed_decile or status != self._printed_status or now - self._printed_at >= self.every_s:
            line = format_progress(
                step, max_steps, status=status, train_loss=train_loss, tokens_per_sec=tokens_per_sec,
                eta_seconds=eta_seconds, restarts=restarts,
            ) + (f"  {waiting_reason}" if waiting_reason else "")
            self.stream.write(line + "\n")
            self.stream.flush()
            self._printed_decile, self._printed_status, self._printed_at = decile, status, now

    def _draw(self, status: str, step: int, max_steps: int | None, details: str) -> None:
        if self._bar is None:
            self._bar = Progress(
                TextColumn("{task.fields[status]:<9}"), BarColumn(), TextColumn("{task.fields[steps]}"),
                TaskProgressColumn(), TextColumn("{task.fields[details]}"), console=Console(file=self.stream),
            )
            self._bar.add_task("", total=max_steps, status="", steps="", details="")
        self._bar.update(
            self._bar.task_ids[0], completed=step, total=max_steps, status=status, steps=steps_text(step, max_steps), details=details
        )
        self._bar.start()  # the first time; after, the bar redraws itself

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()  # drawn a last time, the cursor on the next line
            self._bar = None


class LatestMetric:
    """The newest value of one of a job's metrics, fetching only the points since the last look."""

    def __init__(self, client: Client, job_id: int, name: str):
        self.client, self.job_id, self.name = client, job_id, name
        self.value: float | None = None
        self._checked_step = -1

    def at(self, job_step: int) -> float | None:
        if job_step > self._checked_step:
            from_step = max(self._checked_step, 0)
            series = self.client.metrics(self.job_id, names=[self.name], from_step=from_step).series.get(self.name)
            if series and series.values:
                self.value = series.values[-1]
            self._checked_step = job_step
        return self.value


def follow_job(client: Client, job_id: int, stream: TextIO | None = None, poll: float = 1.0) -> JobOut:
    """Show the job's progress until it ends; returns its final state."""
    bar = ProgressBar(stream)
    train_loss = LatestMetric(client, job_id, "train_loss")

    def show(job: JobOut) -> None:
        # A custom loop's or a script's tokens per step are their own business.
        model = job.spec.model
        tokens_per_sample = {"gpt": "block_size", "mlp": "max_length", "hf": "max_length"}.get(model.kind) if model else None
        tokens_per_step = job.effective_batch_size * getattr(model, tokens_per_sample) if tokens_per_sample else None
        bar.update(job.status.value, job.step, job.max_steps, train_loss.at(job.step), tokens_per_step, job.restarts, job.waiting_reason)

    try:
        return client.wait(job_id, poll=poll, on_update=show)
    finally:
        bar.close()
