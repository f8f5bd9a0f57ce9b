"""What a `script` job's processes get from Trainyard, through Accelerate's own API.

Installed by workers/script_site/sitecustomize.py when Accelerate is imported:
- every `Accelerator` on the main process gets a TrainyardTracker in `accelerator.trackers`, so
  `accelerator.log(...)` reaches the job's metrics with or without `log_with` and `init_trackers`;
- an Accelerator with no project directory of its own gets TRAINYARD_CHECKPOINT_DIR, so
  `ProjectConfiguration(automatic_checkpoint_naming=True)` saves under it;
- `accelerator.save_state(...)`, once every process has written its part, gets a manifest (sha256
  of each file) and is reported as a checkpoint of its own (checkpoint_step says at which step).
  Before save_state returns, the folder is handed over: renamed out of the script's way, under
  TRAINYARD_CHECKPOINT_DIR (hand_over). The worker then moves it into the artifact store (copies
  it, across filesystems), keeping its folder's name, and gives that folder back to resume from;
- `accelerator.load_state(".../checkpoint_3")` under automatic checkpoint naming goes on naming
  from `checkpoint_4`, as the run it resumes would have;
- destroying the process group waits for gloo's threads first (workers/process_group_exit.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import re
import sys
import warnings
from pathlib import Path

from api_schemas.worker_protocol import CHECKPOINT_DIR_ENV
from workers.process_group_exit import guard_process_group_exit

HOOKED_MODULE = "accelerate.accelerator"


class _HookOnImport(importlib.abc.MetaPathFinder):
    """Finds accelerate.accelerator like everyone else, then patches it right after it runs."""

    def find_spec(self, name, path, target=None):
        if name != HOOKED_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            patch(module.Accelerator)

        spec.loader.exec_module = exec_module
        return spec


def install_on_import() -> None:
    if HOOKED_MODULE in sys.modules:
        patch(sys.modules[HOOKED_MODULE].Accelerator)
    else:
        sys.meta_path.insert(0, _HookOnImport())


def patch(accelerator_class) -> None:
    if getattr(accelerator_class, "_trainyard_patched", False):
        return
    accelerator_class._trainyard_patched = True
    guard_process_group_exit()
    original_init, original_save_state = accelerator_class.__init__, accelerator_class.save_state
    original_load_state = accelerator_class.load_state

    def __init__(self, *args, project_dir=None, project_config=None, **kwargs):
        checkpoint_dir = os.environ.get(CHECKPOINT_DIR_ENV)
        if checkpoint_dir and project_dir is None:
            if project_config is None:
                project_dir = checkpoint_dir
            elif project_config.project_dir is None:
                project_config.set_directories(checkpoint_dir)
        with warnings.catch_warnings():
            # Trainyard's tracker takes what is logged whatever `log_with` found: "no supported trackers
            # are currently installed" (a script's `log_with="all"`) read as an error in every job's log.
            warnings.filterwarnings("ignore", message=r"`log_with=.*` was passed but no supported trackers")
            original_init(self, *args, project_dir=project_dir, project_config=project_config, **kwargs)
        self._trainyard_tracker = None
        if self.is_main_process:
            from workers.tracker import TrainyardTracker

            self._trainyard_tracker = TrainyardTracker.from_env()
            self.trackers.append(self._trainyard_tracker)

    def save_state(self, *args, **kwargs):
        iteration = self.save_iteration  # save_state counts it up
        location = original_save_state(self, *args, **kwargs)
        self.wait_for_everyone()  # every process's part (its RNG state) is on disk
        tracker = self._trainyard_tracker
        if tracker is not None and location:
            report_checkpoint(tracker, Path(location), iteration, self.project_configuration.automatic_checkpoint_naming)
        self.wait_for_everyone()  # nobody writes the next checkpoint into a folder being hashed
        return location

    def load_state(self, input_dir=None, *args, **kwargs):
        result = original_load_state(self, input_dir, *args, **kwargs)
        # Accelerate starts counting its saves at 0 in every run: without this, a resumed run's next
        # automatic save would be checkpoint_0 again, named as if before the one it resumed from.
        number = re.fullmatch(r"checkpoint_(\d+)", Path(input_dir).name) if input_dir else None
        if self.project_configuration.automatic_checkpoint_naming and number:
            self.project_configuration.iteration = max(self.project_configuration.iteration, int(number.group(1)) + 1)
        return result

    accelerator_class.__init__ = __init__
    accelerator_class.save_state = save_state
    accelerator_class.load_state = load_state


def checkpoint_step(folder_name: str, last_logged_step: int | None, save_iteration: int, automatic_naming: bool) -> int:
    """The step a checkpoint folder was saved at: the number its name ends with (`step_1200`,
    `checkpoint-1200`, and an `epoch_3` by its epoch, as the script itself counts on resuming), else
    Accelerate's count of saves when it names the folders, else the last step given to
    `accelerator.log`, else that count. Not the last logged step first: a script that logs once an
    epoch saves many checkpoints between two logs."""
    if number := re.search(r"(\d+)$", folder_name):
        return int(number.group(1))
    if automatic_naming or last_logged_step is None:
        return save_iteration
    return last_logged_step


def report_checkpoint(tracker, directory: Path, save_iteration: int, automatic_naming: bool) -> None:
    from api_schemas.manifest import write_manifest

    directory = directory.resolve()
    step = checkpoint_step(directory.name, tracker.last_step, save_iteration, automatic_naming)
    if (earlier := tracker.checkpoints_by_step.get(step)) is not None:
        print(
            f"trainyard: checkpoint {directory.name} gets step {step}, as {earlier} did before it; both are kept, "
            "as two checkpoints", file=sys.stderr, flush=True,
        )
    tracker.checkpoints_by_step[step] = directory.name
    write_manifest(directory, step)
    tracker.checkpoint(step, hand_over(directory))


def hand_over(directory: Path) -> Path:
    """Where the worker takes the saved folder from: renamed, at once, to a folder of its own under
    TRAINYARD_CHECKPOINT_DIR (`.handed-over/<n>/<its name>`, n counting the saves). From then on
    the script can't change or delete it: Accelerate's `total_limit` (and scripts' own rotation)
    deletes old checkpoint folders, and a script that saves to one name each time (`latest`)
    writes into it again, both possibly before the worker has taken it in. Left where it is (and taken from
    there) when it can't be renamed: on another filesystem, or with no TRAINYARD_CHECKPOINT_DIR."""
    root = os.environ.get(CHECKPOINT_DIR_ENV)
    if not root:
        return directory
    handed_over = Path(root) / ".handed-over"
    try:
        handed_over.mkdir(parents=True, exist_ok=True)
        number = len(os.listdir(handed_over))
        while True:  # a folder no other save took (each Accelerator of the process hands over here)
            try:
                (handed_over / str(number)).mkdir()
                break
            except FileExistsError:
                number += 1
        target = handed_over / str(number) / directory.name
        os.rename(directory, target)
    except OSError as exc:
        print(f"trainyard: checkpoint {directory} stays where it was saved ({exc}); do not change it until stored",
              file=sys.stderr, flush=True)
        return directory
    return target
