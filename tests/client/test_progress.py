from __future__ import annotations

import io

import pytest

from trainyard.progress import ProgressBar, StepRate, format_duration, format_progress, format_rate


def test_format_progress_with_everything_known():
    line = format_progress(
        750, 2000, status="running", train_loss=1.93214, tokens_per_sec=6143.0, eta_seconds=205, restarts=1, width=10
    )
    assert line == "running    [###.......]  750/2000   38%  loss 1.9321  6.1k tok/s  ETA 3m25s  restarts 1"


def test_format_progress_leaves_out_what_is_unknown_and_clamps():
    assert format_progress(0, 100, width=4) == "[....]  0/100    0%"
    assert format_progress(120, 100, width=4) == "[####]  120/100  100%"
    assert format_progress(5, None, width=4) == "step 5"  # a script job that gave no max_steps


def test_durations_and_rates():
    assert [format_duration(s) for s in (0, 59.6, 61, 3725)] == ["0s", "1m00s", "1m01s", "1h02m"]
    assert [format_rate(r) for r in (512, 6143, 2_500_000)] == ["512 tok/s", "6.1k tok/s", "2.5M tok/s"]


def test_step_rate_is_smoothed_follows_a_lasting_change_and_restarts():
    rate = StepRate(tau=10)
    assert rate.steps_per_second() is None
    rate.add(0, 10)
    rate.add(5, 10)  # unchanged step: no new information
    rate.add(10, 110)
    assert rate.steps_per_second() == 10
    rate.add(11, 111)  # one slow second moves the estimate a little...
    assert 9 < rate.steps_per_second() < 10
    for second in range(12, 80):  # ...a slowdown that lasts, all the way
        rate.add(second, 111 + second - 11)
    assert rate.steps_per_second() == pytest.approx(1, abs=0.05)
    rate.add(81, 50)  # resumed from an earlier checkpoint
    assert rate.steps_per_second() is None


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_tenth_and_per_status_change():
    out = io.StringIO()
    bar = ProgressBar(out, clock=iter(range(1000)).__next__)
    bar.update("queued", 0, 100)
    for step in range(0, 101, 5):
        bar.update("running", step, 100, train_loss=2.0, tokens_per_step=64)
    bar.update("succeeded", 100, 100)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("queued") and lines[-1].startswith("succeeded")
    assert [line.split()[2] for line in lines[1:-1]] == [f"{n}/100" for n in range(0, 101, 10)]
    assert lines[-3].endswith("90/100   90%  loss 2.0000  320 tok/s  ETA 2s")  # 5 steps per clock tick, 64 tokens each


def test_a_log_gets_a_line_every_so_many_seconds_of_a_slow_job():
    out = io.StringIO()
    bar = ProgressBar(out, clock=iter(range(0, 1000, 4)).__next__, every_s=10)  # 4 s between polls
    for step in range(1, 9):  # 1% a poll: no tenth crossed
        bar.update("running", 100 + step, 1000)
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["101/1000", "104/1000", "107/1000"]  # at 0, 12 and 24 s
    assert lines[-1].endswith("ETA 59m32s")  # 893 steps at a quarter step a second


def test_a_queued_jobs_lines_say_why_it_waits():
    # `--follow` on a queued job printed `queued step 0` every 10 s and nothing more.
    out = io.StringIO()
    bar = ProgressBar(out, clock=iter(range(0, 1000, 5)).__next__, every_s=10)
    reason = "waiting for a host with 2 free CPU slots; 0 hosts have that free now"
    for _ in range(4):
        bar.update("queued", 0, 100, waiting_reason=reason)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith("queued") and line.endswith(reason) for line in lines), lines


def test_a_terminal_gets_a_rich_bar_redrawn_in_place(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # wide enough for the whole line
    out = FakeTerminal()
    bar = ProgressBar(out)
    bar.update("running", 10, 100, train_loss=3.0)
    bar.update("running", 20, 100, train_loss=2.5)
    bar.close()
    drawn = out.getvalue()
    assert "\x1b[" in drawn and "━" in drawn  # rich's cursor moves and bar
    assert "loss 2.5000" in drawn and "20/100" in drawn and drawn.endswith("\n\x1b[?25h")  # on a line of its own, cursor shown
