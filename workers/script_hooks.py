"""What a `script` job's processes get from Trainyard, through Accelerate's own API.

Installed by workers/script_site/sitecustomize.py when Accelerate is imported:
- every `Accelerator` on the main process gets a TrainyardTracker in `accelerator.trackers`, so
  `accelerator.log(...)` reaches the job's metrics with or without `log_with` and `init_trackers`;
- an Accelerator with no project directory of its own gets TRAINYARD_CHECKPOINT_DIR, so
  `ProjectConfiguration(automatic_checkpoint_naming=True)` saves under it;
- `accelerator.save_state(...)`, once every process has written its part, gets a manifest (sha256
  of each file) and is reported as a checkpoint, numbered by the last step passed to
  `accelerator.log` (else the number at the end of the folder's name). The worker then moves it
  into the artifact store (copies it and deletes it here, across filesystems).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import re
import sys
from pathlib import Path

from api_schemas.worker_protocol import CHECKPOINT_DIR_ENV

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
    original_init, original_save_state = accelerator_class.__init__, accelerator_class.save_state

    def __init__(self, *args, project_dir=None, project_config=None, **kwargs):
        checkpoint_dir = os.environ.get(CHECKPOINT_DIR_ENV)
        if checkpoint_dir and project_dir is None:
            if project_config is None:
                project_dir = checkpoint_dir
            elif project_config.project_dir is None:
                project_config.set_directories(checkpoint_dir)
        original_init(self, *args, project_dir=project_dir, project_config=project_config, **kwargs)
        self._trainyard_tracker = None
        if self.is_main_process:
            from workers.tracker import TrainyardTracker

            self._trainyard_tracker = TrainyardTracker.from_env()
            self.trackers.append(self._trainyard_tracker)

    def save_state(self, *args, **kwargs):
        location = original_save_state(self, *args, **kwargs)
        self.wait_for_everyone()  # every process's part (its RNG state) is on disk
        tracker = self._trainyard_tracker
        if tracker is not None and location:
            report_checkpoint(tracker, Path(location))
        self.wait_for_everyone()  # nobody writes the next checkpoint into a folder being hashed
        return location

    accelerator_class.__init__ = __init__
    accelerator_class.save_state = save_state


def report_checkpoint(tracker, directory: Path) -> None:
    from api_schemas.manifest import write_manifest

    directory = directory.resolve()
    if tracker.last_step is not None:
        step = tracker.last_step
    else:
        number = re.search(r"(\d+)$", directory.name)
        step = int(number.group(1)) if number else 0
    write_manifest(directory, step)
    tracker.checkpoint(step, directory)
