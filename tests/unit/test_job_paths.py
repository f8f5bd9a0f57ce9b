"""The worker's hands on a job's files (workers/job_paths.py): no link of the job's is followed, at
any depth, and what is taken is the worker's own copy before anything else is done with it.

Found by a hostile user's trial, each with a script job that swapped a directory for a link between
the worker's check and its use: another user's checkpoint moved into its own job, a root-only
directory deleted, the host's token and the service's logs copied out as its outputs. Here each
swap is made before the worker's step, which is what winning the race amounts to."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from workers.job_paths import NotTheJobs, OverBudget, copy_out, handover_directory, take_out


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "attempt").mkdir()
    return tmp_path / "attempt"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """Another user's checkpoint, somewhere the job can't see."""
    checkpoint = tmp_path / "store" / "jobs" / "3" / "checkpoints" / "step_3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_text("bob's weights")
    return checkpoint


def test_a_checkpoint_is_moved_out_of_the_jobs_reach_and_a_later_swap_changes_nothing(run_dir, victim):
    (run_dir / "d" / "step_3").mkdir(parents=True)
    (run_dir / "d" / "step_3" / "model.safetensors").write_text("alice's weights")
    handed = take_out(run_dir, run_dir / "d" / "step_3")
    assert handed.parent == handover_directory(run_dir) and (handed / "model.safetensors").read_text() == "alice's weights"
    # The job swaps its directory for a link to the victim's: the worker deletes its own copy once stored.
    os.rename(run_dir / "d", run_dir / "d.old")
    os.symlink(victim.parent, run_dir / "d")
    shutil.rmtree(handed)
    assert (victim / "model.safetensors").read_text() == "bob's weights"


def test_a_checkpoint_under_a_linked_directory_is_not_taken(run_dir, victim):
    # The event names d/step_3 with d a link to another user's checkpoints: it was moved into this job.
    os.symlink(victim.parent, run_dir / "d")
    with pytest.raises(NotTheJobs):
        take_out(run_dir, run_dir / "d" / "step_3")
    assert (victim / "model.safetensors").read_text() == "bob's weights"
    assert not any(handover_directory(run_dir).iterdir())


def test_a_checkpoint_that_is_a_link_is_left_as_it_was(run_dir, victim):
    os.symlink(victim, run_dir / "step_3")
    with pytest.raises(NotTheJobs):
        take_out(run_dir, run_dir / "step_3")
    assert (run_dir / "step_3").is_symlink() and os.readlink(run_dir / "step_3") == str(victim)
    assert (victim / "model.safetensors").exists()


def test_nothing_outside_the_attempt_is_taken(run_dir, victim):
    for outside in (victim, run_dir / ".." / "store", run_dir, Path("step_3")):
        with pytest.raises(NotTheJobs):
            take_out(run_dir, outside)
    assert (victim / "model.safetensors").exists()


def test_an_output_is_copied_without_following_any_link_or_opening_a_fifo(run_dir, victim, tmp_path):
    out = run_dir / "code" / "out"
    (out / "sub").mkdir(parents=True)
    (out / "result.txt").write_text("alice's result")
    (out / "sub" / "more.txt").write_text("more")
    os.symlink(victim, out / "stolen")  # a link inside: left out
    os.symlink(victim / "model.safetensors", out / "stolen.safetensors")
    os.mkfifo(out / "fifo")  # would block an open
    folder = copy_out(run_dir, out, "out", max_bytes=2**20)
    assert folder.is_relative_to(handover_directory(run_dir))
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == ["out", "out/result.txt", "out/sub", "out/sub/more.txt"]
    # The output itself a link (to the victim's directory, to a root-only one): not copied.
    shutil.rmtree(out)
    os.symlink(victim.parent, out)
    with pytest.raises(NotTheJobs):
        copy_out(run_dir, out, "out", max_bytes=2**20)
    # A directory above it a link: not followed either.
    os.unlink(out)
    os.rename(run_dir / "code", run_dir / "code.old")
    os.symlink(victim.parent.parent, run_dir / "code")
    with pytest.raises(NotTheJobs):
        copy_out(run_dir, run_dir / "code" / "checkpoints", "checkpoints", max_bytes=2**20)


def test_a_sparse_output_is_counted_whole_and_refused_past_the_budget(run_dir):
    out = run_dir / "out"
    out.mkdir()
    with open(out / "sparse.bin", "wb") as file:
        file.truncate(2**30)  # a gigabyte of nothing on disk: real bytes in the store
    with pytest.raises(OverBudget, match="sparse files counted whole"):
        copy_out(run_dir, out, "out", max_bytes=2**20)
    assert not any(handover_directory(run_dir).rglob("sparse.bin"))  # what was copied is gone
