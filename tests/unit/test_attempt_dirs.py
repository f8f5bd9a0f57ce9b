"""Ended attempts' directories (workers/attempt_dirs.py): removed once their time is up, a warm
attempt's slot with its link, a failed one kept for its retention."""

from __future__ import annotations

from api_schemas import AttemptStatus
from workers import attempt_dirs
from workers.attempt_dirs import EndedAttempts


def test_a_finished_attempts_directory_goes_and_a_failed_one_stays_for_its_retention(tmp_path, monkeypatch):
    monkeypatch.setattr(attempt_dirs, "FINISHED_RETENTION_SECONDS", 0.0)
    work = tmp_path / "work"
    succeeded, failed = work / "job-1" / "attempt-1", work / "job-2" / "attempt-1"
    for run_dir in (succeeded, failed):
        (run_dir / "code").mkdir(parents=True)
        (run_dir / "events.jsonl").write_text("{}\n")
    ended = EndedAttempts(failed_retention_hours=1)
    ended.ended(succeeded, AttemptStatus.succeeded)
    ended.ended(failed, AttemptStatus.failed)
    ended.sweep()
    assert not (work / "job-1").exists()  # the job's directory too, once empty
    assert (failed / "events.jsonl").exists()


def test_a_warm_attempts_link_and_its_interpreters_slot_go_together(tmp_path, monkeypatch):
    monkeypatch.setattr(attempt_dirs, "FINISHED_RETENTION_SECONDS", 0.0)
    slot = tmp_path / "work" / "warm" / "ab12"
    (slot / "run" / "checkpoints").mkdir(parents=True)
    (slot / "inputs").mkdir()
    link = tmp_path / "work" / "job-3" / "attempt-1"
    link.parent.mkdir(parents=True)
    link.symlink_to(slot / "run", target_is_directory=True)
    ended = EndedAttempts(failed_retention_hours=0)
    ended.ended(link, AttemptStatus.cancelled)
    ended.sweep()
    assert not slot.exists() and not link.is_symlink() and (tmp_path / "work" / "warm").is_dir()


def test_an_agent_that_exits_after_its_attempt_removes_its_directory_now_unless_it_failed(tmp_path):
    # A Slurm agent runs one attempt and exits: no one would sweep its directory in ten minutes
    # (every try's stayed on the shared work root: found trying the Slurm pool as a new admin).
    work = tmp_path / "work"
    done, failed, later = work / "job-1" / "attempt-1", work / "job-2" / "attempt-1", work / "job-3" / "attempt-1"
    for run_dir in (done, failed, later):
        run_dir.mkdir(parents=True)
    ended = EndedAttempts(failed_retention_hours=1)
    ended.ended(done, AttemptStatus.preempted)
    ended.ended(failed, AttemptStatus.lost)
    ended.sweep(finished_now=True)
    assert not done.exists() and failed.exists()
    ended.ended(later, AttemptStatus.succeeded)
    ended.sweep()  # not yet: its ten minutes
    assert later.exists()
