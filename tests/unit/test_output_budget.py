"""An attempt's output as the worker keeps it (workers/supervisor.py): a budget of lines per attempt and a
bound on what waits to be stored, every dropped line counted and said; a failure reason that ends with
the user's error, not the launcher's traceback; a best checkpoint that can't be ranked, said."""

from __future__ import annotations

from api_schemas import CheckpointConfig
from workers.outbox import MAX_LOG_LINE, MAX_PENDING_LOG_CHARS, DroppedLines, Outbox
from workers.supervisor import unranked_best_note, without_launcher_traceback


def test_past_the_budget_lines_are_dropped_with_a_line_saying_so_at_once_and_how_many_at_the_end():
    dropped = DroppedLines(budget=3)
    taken = [dropped.take(0) for _ in range(10)]
    assert [keep for keep, _ in taken] == [True] * 3 + [False] * 7
    assert [notes for _, notes in taken if notes] == [["trainyard: 3 lines stored, the attempt's log budget: later lines are dropped and counted"]]
    assert dropped.resumed() == ["trainyard: 7 lines of output dropped here: over the attempt's log budget of 3 lines (max_log_lines_per_attempt)"]
    assert dropped.resumed() == []  # said once


def test_lines_printed_faster_than_they_are_stored_are_dropped_and_counted_where_they_were():
    dropped = DroppedLines(budget=1000)
    assert dropped.take(MAX_PENDING_LOG_CHARS) == (False, []) and dropped.take(MAX_PENDING_LOG_CHARS) == (False, [])
    keep, notes = dropped.take(0)  # the backlog was stored meanwhile
    assert keep and notes == ["trainyard: 2 lines of output dropped here: printed faster than they could be stored (32 MiB of lines were waiting)"]


def test_the_outbox_counts_the_characters_waiting_and_cuts_overlong_lines():
    outbox = Outbox()
    outbox.add_line(0, "x" * (MAX_LOG_LINE + 10))
    outbox.add_line(None, "short")
    assert outbox.log_chars == MAX_LOG_LINE + 5 and outbox.backlog()
    assert [seq for seq, _, _ in outbox.next_lines(1)] == [0]
    outbox.drop_lines(1)
    assert outbox.log_chars == 5 and [line for _, _, line in outbox.logs] == ["short"]
    outbox.drop_lines(1)
    assert outbox.empty()


def test_a_failure_reason_ends_with_the_users_error_not_the_launchers_traceback():
    user = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "ValueError: bad learning rate"]
    launcher = ["Traceback (most recent call last):", '  File ".../accelerate/commands/launch.py", line 1, in simple_launcher',
                "subprocess.CalledProcessError: Command '['python', 'train.py']' returned non-zero exit status 1."]
    assert without_launcher_traceback(user + launcher) == user
    assert without_launcher_traceback(user) == user  # nothing of the launcher's: as it was
    assert without_launcher_traceback(launcher) == launcher  # nothing else to show: kept


def test_a_multi_process_failure_reason_ends_with_the_ranks_error_not_torchelastics_table():
    # Of a 2-process script's `raise RuntimeError("boom")`, the reason held only torchelastic's lines.
    ranks = ['[default0]:[rank0]: Traceback (most recent call last):', '[default0]:[rank0]:     raise RuntimeError("boom")',
             "[default0]:[rank0]: RuntimeError: boom",
             "E1130 00:41:19.006000 15646 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0"]
    launcher = ["Traceback (most recent call last):", '  File ".../torch/distributed/launcher/api.py", line 383, in launch_agent',
                "    raise ChildFailedError(", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 60,
                "boom.py FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "Root Cause (first observed failure):", "[0]:",
                "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 15650)", "=" * 60]
    assert without_launcher_traceback(ranks + launcher) == ranks


def test_a_best_checkpoint_ranked_by_a_metric_never_logged_is_said_with_what_was_logged():
    policy = CheckpointConfig(keep_best=True, best_metric="val/acc", best_mode="max")
    assert unranked_best_note(policy, {"loss", "val/accuracy"}) == (
        "trainyard: checkpoint.keep_best ranks checkpoints by 'val/acc', which this attempt never logged: no checkpoint is kept "
        "as its best (checkpoint.best_metric; it logged: loss, val/accuracy)")
    assert unranked_best_note(policy, {"val/acc"}) is None
    assert unranked_best_note(CheckpointConfig(), set()) is None  # no keep_best: nothing to rank
    assert unranked_best_note(CheckpointConfig(keep_best=True), set()).endswith("it logged: none)")


def test_a_reports_lines_fit_the_apis_request_size():
    # 1,000 lines of 4,000 characters were one report: 413 from the API, sent again, for ever.
    from workers.outbox import LINE_CHARS_PER_BATCH
    from workers.supervisor import LINES_PER_BATCH

    outbox = Outbox()
    for seq in range(1000):
        outbox.add_line(seq, "é" * MAX_LOG_LINE)
    lines = outbox.next_lines(LINES_PER_BATCH)
    assert 0 < len(lines) and sum(len(line) for _, _, line in lines) <= LINE_CHARS_PER_BATCH
    assert len(outbox.next_lines(LINES_PER_BATCH, chars=10)) == 1  # a line longer than the budget still goes, alone
