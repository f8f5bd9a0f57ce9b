"""Elastic runs: the same optimizer steps on however many processes the job gets.

An optimizer step is defined by the spec's effective batch (micro_batch_size ×
gradient_accumulation_steps × the spec's processes), not by the processes running it. On M
processes the accumulation is whatever makes that batch: a job of 2 processes resumed on 1
accumulates twice as many micro-batches. The samples are the same too: the dataloader deals the
global order of micro-batches round-robin over the ranks (Accelerate's dispatch), so each global
batch is split across whatever ranks exist, and a step trains on the same samples whatever M is.
Only the summation order of the gradient changes (and dropout masks, drawn per process).
"""

from __future__ import annotations

from api_schemas import JobSpec
from workers.training.data import SpecError


def accumulation_steps(spec: JobSpec, processes: int) -> int:
    """Micro-batches per optimizer step on `processes` processes, for the spec's effective batch."""
    batch, micro = spec.effective_batch_size, spec.training.micro_batch_size
    if batch % (micro * processes):
        raise SpecError(
            f"training.gradient_accumulation_steps: an optimizer step of {batch} samples (micro_batch_size {micro} × "
            f"{spec.training.gradient_accumulation_steps} × {spec.world_size} processes) cannot be split into whole "
            f"micro-batches on {processes} processes"
        )
    return batch // (micro * processes)


def batches_on(progress: dict, processes: int, spec: JobSpec) -> int:
    """The position in the epoch of a checkpoint, in micro-batches per process of `processes`
    processes (a checkpoint counts them for the processes that wrote it; older ones wrote the spec's)."""
    written = progress["batch_in_epoch"] * progress.get("processes", spec.world_size)
    if written % processes:
        raise SpecError(f"resources: the checkpoint's position in the epoch does not split over {processes} processes")
    return written // processes


def skipped(progress: dict, steps: int, micro_batches_per_step: int, epoch_length: int) -> dict:
    """The data position `steps` optimizer steps past `progress` (the step count unchanged): where a
    rolled-back run goes on, past the batches its spike was trained on. An epoch holds whole steps
    (the data's `multiple_of`), so the position moves on in whole epochs past its end."""
    position = progress["batch_in_epoch"] + steps * micro_batches_per_step
    return {**progress, "epoch": progress["epoch"] + position // epoch_length, "batch_in_epoch": position % epoch_length}
