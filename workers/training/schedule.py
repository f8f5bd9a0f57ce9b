"""Learning-rate schedules as a closed form of the optimizer step (nanoGPT's shapes)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from api_schemas import JobSpec


def lr_at(step: int, spec: JobSpec) -> float:
    """The learning rate used by optimizer step number `step` (0 for the first step)."""
    peak, floor, warmup, total = spec.optimizer.lr, spec.schedule.min_lr, spec.warmup_steps, spec.training.max_steps
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if spec.schedule.name == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if spec.schedule.name == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)


def make_scheduler(optimizer: torch.optim.Optimizer, spec: JobSpec, num_processes: int) -> LambdaLR:
    # Accelerate's prepared scheduler calls step() once per process on every optimizer step
    # (its convention for schedules counted in per-process batches); dividing the count by the
    # number of processes keeps `lr_at` a function of the optimizer step for any process count.
    return LambdaLR(optimizer, lambda count: lr_at(count // num_processes, spec) / spec.optimizer.lr)


def recount_scheduler(scheduler, step: int, num_processes: int) -> None:
    """After loading a checkpoint: the count as `num_processes` processes reach `step` (see
    make_scheduler), whatever number of processes wrote it."""
    scheduler.scheduler.last_epoch = step * num_processes
