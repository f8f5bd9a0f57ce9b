"""Removing the directories of ended attempts, so that a host's disk doesn't fill with them.

Once an attempt has ended, all it produced that matters is in the store (checkpoints, outputs)
and in the database (metrics, logs): its directory (its spec, events file, a script's copy of its
code, input copies, per-rank logs, what the job wrote besides) is kept a while only for whoever
looks into it on the host, then removed. A failed or lost attempt is kept longer
(`failed_attempt_retention_hours`), for its owner or operator to look into. An attempt that
started warm is a link to its interpreter's slot (workers/warm_pool.py): the slot goes with it.

The worker remembers which directories it is to remove; a worker restarted meanwhile forgets
those of the attempts before (the operator's to remove, under the work root's `job-*`).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

from api_schemas import AttemptStatus
from workers.job_paths import handover_directory

FINISHED_RETENTION_SECONDS = 600.0  # succeeded, cancelled, preempted: everything of it is stored


class EndedAttempts:
    def __init__(self, failed_retention_hours: float):
        self.failed_retention_s = failed_retention_hours * 3600
        self._due: list[tuple[float, Path, bool]] = []  # (when, attempt directory, kept as failed)
        self._lock = threading.Lock()  # attempts end on several task threads; the heartbeat sweeps

    def ended(self, run_dir: Path, outcome: AttemptStatus | None) -> None:
        """`run_dir`'s attempt ended with `outcome` (None: its lease was lost)."""
        failed = outcome in (None, AttemptStatus.failed, AttemptStatus.lost)
        kept = self.failed_retention_s if failed else FINISHED_RETENTION_SECONDS
        with self._lock:
            self._due.append((time.monotonic() + kept, run_dir, failed))

    def sweep(self, finished_now: bool = False) -> None:
        """Remove the directories whose time has come; `finished_now`: those of every attempt that
        didn't fail too (a Slurm agent runs one attempt and exits: no one would sweep them later)."""
        now = time.monotonic()
        due, kept = [], []
        with self._lock:
            for entry in self._due:
                when, _, failed = entry
                (due if when <= now or (finished_now and not failed) else kept).append(entry)
            self._due = kept
        for _, run_dir, _ in due:
            remove_attempt_dir(run_dir)


def remove_attempt_dir(run_dir: Path) -> None:
    """The attempt's directory, or the warm slot it links to and the link; what the worker took out
    of it (workers/job_paths.py); its job's directory too once empty."""
    shutil.rmtree(handover_directory(run_dir), ignore_errors=True)
    if run_dir.is_symlink():
        slot = run_dir.resolve().parent  # <slot>/run
        run_dir.unlink(missing_ok=True)
        shutil.rmtree(slot, ignore_errors=True)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    try:
        run_dir.parent.rmdir()  # job-N, if no other attempt of it is left here
    except OSError:
        pass
