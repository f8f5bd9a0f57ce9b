"""The events file between the training processes and the worker (api_schemas/worker_protocol.py)."""

from __future__ import annotations

import json
import os
import math
from pathlib import Path

import pytest

from api_schemas.worker_protocol import CheckpointEvent, MetricsEvent, decode_events, encode_event


def test_events_come_back_as_they_were_written_in_the_lines_the_service_has_always_read():
    written = [
        MetricsEvent(step=1, values={"train_loss": 2.5, "lr": 1e-3}),
        CheckpointEvent(step=6, path=Path("/work/job-1/attempt-1/checkpoints/step-00000006")),
    ]
    data = "".join(map(encode_event, written)).encode()
    assert data.decode().splitlines() == [
        '{"type": "metrics", "step": 1, "values": {"train_loss": 2.5, "lr": 0.001}}',
        '{"type": "checkpoint", "step": 6, "path": "/work/job-1/attempt-1/checkpoints/step-00000006"}',
    ]
    assert decode_events(data) == (written, len(data))


def test_a_diverged_metric_is_written_as_nan_and_read_back_as_nan():
    [event], _ = decode_events(encode_event(MetricsEvent(step=3, values={"train_loss": math.nan})).encode())
    assert math.isnan(event.values["train_loss"])


def test_a_torn_last_line_is_left_for_the_next_read():
    whole = encode_event(MetricsEvent(step=1, values={"loss": 1.0})).encode()
    torn = encode_event(MetricsEvent(step=2, values={"loss": 0.5})).encode()
    events, used = decode_events(whole + torn[:10])
    assert [event.step for event in events] == [1] and used == len(whole)
    assert decode_events(torn[:10]) == ([], 0)
    events, used = decode_events(torn[:10] + torn[10:])  # the rest of the line arrived
    assert [event.step for event in events] == [2] and used == len(torn)


def test_a_line_of_an_unknown_type_is_skipped_and_a_line_that_is_no_event_is_an_error():
    newer = json.dumps({"type": "profile", "step": 1, "trace": "…"}).encode() + b"\n"
    metrics = encode_event(MetricsEvent(step=1, values={"loss": 1.0})).encode()
    assert decode_events(newer + b"\n" + metrics) == ([MetricsEvent(step=1, values={"loss": 1.0})], len(newer) + 1 + len(metrics))
    for broken in (b'{"type": "metrics", "step": 1}\n', b'{"step": 1}\n', b"not json\n"):
        with pytest.raises(ValueError):
            decode_events(broken)


def test_the_supervisor_skips_lines_of_the_events_file_that_are_no_event(tmp_path: Path):
    """The events file is in the job's own directory: a hostile or careless job may write anything
    there. The supervisor keeps every real event around such lines and goes on (it raised, and the
    attempt lost its supervisor)."""
    from workers.outbox import EventTail

    path = tmp_path / "events.jsonl"
    good = [MetricsEvent(step=1, values={"loss": 2.0}), MetricsEvent(step=2, values={"loss": 1.5})]
    path.write_text(encode_event(good[0]) + '{"type": "metrics", "step": "NaN"}\nnot json at all\n' + encode_event(good[1]) + '{"type": "met')
    tail = EventTail(path)
    assert tail.read() == good and tail.skipped == 2
    with open(path, "a") as f:  # the half-written line completes, as an event after all
        f.write('rics", "step": 3, "values": {"loss": 1.0}}\n')
    assert tail.read() == [MetricsEvent(step=3, values={"loss": 1.0})] and tail.skipped == 2


def test_an_events_file_made_a_fifo_or_a_sparse_giant_neither_blocks_nor_fills_the_worker(tmp_path: Path):
    # A hostile script: the events file replaced by a FIFO wedged the worker's thread (its open
    # blocked), and the host's slot with it; one truncated to 3 GB without a newline was read whole,
    # every round (3 GB of the worker's memory).
    from workers.outbox import EVENTS_READ_BYTES, EventTail

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    assert EventTail(fifo).read() == []
    sparse = tmp_path / "sparse.jsonl"
    with open(sparse, "wb") as file:
        file.truncate(3 * EVENTS_READ_BYTES)
    tail = EventTail(sparse)
    for _ in range(3):
        assert tail.read() == []
    assert tail.offset == 3 * EVENTS_READ_BYTES and tail.skipped == 3
    with open(sparse, "ab") as file:  # what comes after is read as ever
        file.write(encode_event(MetricsEvent(step=1, values={"loss": 1.0})).encode())
    assert [event.step for event in tail.read()] == [1]
