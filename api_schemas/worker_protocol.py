"""How the worker and the training processes it launches talk: environment variables, an events
file and exit codes.

The training processes append one JSON line per event (MetricsEvent, CheckpointEvent) to the file
named by EVENTS_FILE_ENV, written with encode_event and read back with decode_events, and exit 0
when done, EXIT_PREEMPTED after checkpointing on SIGTERM, EXIT_ROLLBACK when the loss guard saw the
run diverge (after a SpikeEvent), anything else on failure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

EVENTS_FILE_ENV = "TRAINYARD_EVENTS_FILE"
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped at a checkpoint, resume later
EXIT_ROLLBACK = 76  # the loss guard stopped a diverging run: resume from the checkpoint before its spike (SpikeEvent)

# A `script` job's processes also get (see workers/script_hooks.py):
CHECKPOINT_DIR_ENV = "TRAINYARD_CHECKPOINT_DIR"  # where save_state() without a directory of its own writes
RESUME_FROM_ENV = "TRAINYARD_RESUME_FROM"  # the checkpoint directory to load_state() from, when resuming


class MetricsEvent(BaseModel):
    """`{"type": "metrics", "step": N, "values": {"train_loss": …, …}}`: one optimizer step's numbers."""

    type: Literal["metrics"] = "metrics"
    step: int
    values: dict[str, float]


class CheckpointEvent(BaseModel):
    """`{"type": "checkpoint", "step": N, "path": "/abs/dir"}`: a complete checkpoint directory (see manifest.py)."""

    type: Literal["checkpoint"] = "checkpoint"
    step: int
    path: Path


class InvalidSpecEvent(BaseModel):
    """`{"type": "invalid_spec", "message": "training.micro_batch_size: …"}`: the training found that
    the job's spec can't run (what admission could not see: the tokenized data, the model as built).
    The attempt fails with this message, and the job is not retried: every attempt would fail the same."""

    type: Literal["invalid_spec"] = "invalid_spec"
    message: str


class SpikeEvent(BaseModel):
    """`{"type": "spike", "first_step": P, "last_step": S, "reason": "…"}`: the loss guard saw the run
    diverge from step P through S (workers/loss_guard.py), and the training exits EXIT_ROLLBACK
    without a checkpoint: the job goes on from its last checkpoint before P, past the batches of
    the steps up to S."""

    type: Literal["spike"] = "spike"
    first_step: int
    last_step: int
    reason: str


Event = Annotated[MetricsEvent | CheckpointEvent | InvalidSpecEvent | SpikeEvent, Field(discriminator="type")]
_EVENT = TypeAdapter(Event)


def encode_event(event: MetricsEvent | CheckpointEvent | InvalidSpecEvent | SpikeEvent) -> str:
    """One line of the events file, newline included. json.dumps, not pydantic's JSON, so a NaN
    metric is written as NaN (not null) and the line reads as it always has."""
    return json.dumps(event.model_dump(mode="json")) + "\n"


def decode_events(data: bytes) -> tuple[list[MetricsEvent | CheckpointEvent | InvalidSpecEvent | SpikeEvent], int]:
    """The events in the complete lines of `data`, and how many bytes those lines take. A last line
    with no newline yet is being written: it is left for the next read. A line of a type this side
    doesn't know (a newer writer's) is skipped; a line that is no event raises ValueError."""
    complete = data[: data.rfind(b"\n") + 1]
    events = []
    for line in complete.splitlines():
        if not line.strip():
            continue
        try:
            events.append(_EVENT.validate_json(line))
        except ValidationError as error:
            if error.errors()[0]["type"] != "union_tag_invalid":
                raise
    return events, len(complete)
