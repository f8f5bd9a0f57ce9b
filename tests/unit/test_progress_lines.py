"""The built-in loop's progress lines in its log: at each evaluation and every so many seconds."""

from __future__ import annotations

import json

from workers.training.reporter import JsonlReporter


def test_progress_is_printed_at_evaluations_and_after_the_interval_every_event_is_written(tmp_path, capsys):
    events = tmp_path / "events.jsonl"
    reporter = JsonlReporter(events, progress_every_s=3600)
    reporter.metrics(1, {"train_loss": 4.17, "lr": 1e-3, "tokens_per_s": 12345.6})  # within the interval: quiet
    reporter.metrics(2, {"train_loss": 3.9, "eval_loss": 3.95, "tokens_per_s": 12000.0})
    reporter.progress_every_s = 0
    reporter.metrics(3, {"train_loss": 3.5, "tokens_per_s": 11000.0})
    reporter.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 2: train_loss=3.9 eval_loss=3.95 tokens/s=12,000",
        "step 3: train_loss=3.5 tokens/s=11,000",
    ]
    assert [json.loads(line)["step"] for line in events.read_text().splitlines()] == [1, 2, 3]


def test_a_script_s_reporter_prints_nothing_of_its_own(tmp_path, capsys):
    reporter = JsonlReporter(tmp_path / "events.jsonl")
    reporter.metrics(1, {"eval_loss": 1.0})
    reporter.close()
    assert capsys.readouterr().out == ""
