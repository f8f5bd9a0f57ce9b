"""What a script's `accelerator.log` and `save_state` become (workers/tracker.py, workers/script_hooks.py),
in this process: a real Accelerator, the hooks installed as a script job's sitecustomize installs them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from api_schemas.manifest import read_manifest
from api_schemas.worker_protocol import CheckpointEvent, MetricsEvent, decode_events
from workers.script_hooks import checkpoint_step, install_on_import
from workers.tracker import TrainyardTracker


@pytest.fixture
def hooked(tmp_path, monkeypatch):
    """Accelerator with Trainyard's hooks, as in a script job's processes; unhooked after the test."""
    for name in ("__init__", "save_state", "load_state"):
        monkeypatch.setattr(Accelerator, name, getattr(Accelerator, name))
    monkeypatch.setattr(Accelerator, "_trainyard_patched", False, raising=False)
    monkeypatch.setenv("TRAINYARD_EVENTS_FILE", str(tmp_path / "events.jsonl"))
    install_on_import()


def events(path) -> list:
    return decode_events(path.read_bytes())[0]


@pytest.mark.parametrize(
    "name, logged, iteration, automatic, step",
    [
        ("step_1200", 817, 5, False, 1200),  # the folder's own number, not the last logged step
        ("checkpoint-1200", None, 0, False, 1200),
        ("epoch_3", 817, 3, False, 3),  # an epoch folder by its epoch, as the script resumes it
        ("checkpoint_4", None, 4, True, 4),  # automatic naming
        ("latest", 817, 2, False, 817),  # no number: the last logged step
        ("latest", None, 2, False, 2),  # never logged: Accelerate's count of saves
    ],
)
def test_a_checkpoint_is_numbered_by_its_folder_then_by_accelerate_then_by_the_last_log(name, logged, iteration, automatic, step):
    assert checkpoint_step(name, logged, iteration, automatic) == step


def test_tensor_numpy_and_bool_metrics_become_floats_and_anything_else_is_warned_about_once(tmp_path, capsys):
    tracker = TrainyardTracker(tmp_path / "events.jsonl")
    for step in (1, 2):
        tracker.log({"eval_loss": torch.tensor(2.5), "acc": np.float32(0.5), "n": np.int64(3), "ok": True,
                     "vec": torch.tensor([1.0, 2.0]), "note": "x", "lr": 1e-3}, step=step)
    tracker.finish()
    assert events(tmp_path / "events.jsonl") == [
        MetricsEvent(step=step, values={"eval_loss": 2.5, "acc": 0.5, "n": 3.0, "ok": 1.0, "lr": 1e-3}) for step in (1, 2)
    ]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trainyard:")]
    assert warnings == ["trainyard: metric 'vec' is a Tensor, not a number; not recorded",
                        "trainyard: metric 'note' is a str, not a number; not recorded"]


def test_every_save_state_folder_is_its_own_checkpoint_even_between_two_logs(hooked, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.log({"loss": 1.0}, step=817)  # an epoch's end
    for name in ("step_1000", "step_1200", "again/step_1200"):
        accelerator.save_state(name)
    accelerator.end_training()
    checkpoints = [e for e in events(tmp_path / "events.jsonl") if isinstance(e, CheckpointEvent)]
    assert [(c.step, c.path) for c in checkpoints] == [
        (1000, tmp_path / "step_1000"), (1200, tmp_path / "step_1200"), (1200, tmp_path / "again" / "step_1200"),
    ]
    assert "checkpoint step_1200 gets step 1200, as step_1200 did before it; both are kept" in capsys.readouterr().err
    del model


def test_automatic_naming_goes_on_from_the_checkpoint_it_resumed(hooked, tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path / "project"), automatic_checkpoint_naming=True)
    first = Accelerator(cpu=True, project_config=config)
    first.prepare(torch.nn.Linear(2, 2))
    saved = [first.save_state() for _ in range(3)]
    assert [Path(s).name for s in saved] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]

    config = ProjectConfiguration(project_dir=str(tmp_path / "resumed"), automatic_checkpoint_naming=True)
    resumed = Accelerator(cpu=True, project_config=config)
    resumed.prepare(torch.nn.Linear(2, 2))
    resumed.load_state(saved[1])
    assert Path(resumed.save_state()).name == "checkpoint_2"


def test_each_save_is_handed_over_before_the_script_can_rotate_or_overwrite_it(hooked, tmp_path, monkeypatch):
    # As in a script job: a checkpoint directory from the worker; the script's folders are its own.
    monkeypatch.setenv("TRAINYARD_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    config = ProjectConfiguration(project_dir=str(tmp_path / "project"), automatic_checkpoint_naming=True, total_limit=1)
    rotating = Accelerator(cpu=True, project_config=config)
    rotating.prepare(torch.nn.Linear(2, 2))
    for _ in range(3):
        rotating.save_state()  # total_limit=1: Accelerate deletes every earlier folder it finds
    overwriting = Accelerator(cpu=True, project_dir=str(tmp_path / "plain"))
    overwriting.prepare(torch.nn.Linear(2, 2))
    for _ in range(2):
        overwriting.save_state(str(tmp_path / "latest"))  # one name each time, by a second Accelerator
    overwriting.end_training()

    handed_over = tmp_path / "checkpoints" / ".handed-over"
    checkpoints = [e for e in events(tmp_path / "events.jsonl") if isinstance(e, CheckpointEvent)]
    assert [(c.step, c.path) for c in checkpoints] == [
        (0, handed_over / "0" / "checkpoint_0"), (1, handed_over / "1" / "checkpoint_1"), (2, handed_over / "2" / "checkpoint_2"),
        (0, handed_over / "3" / "latest"), (1, handed_over / "4" / "latest"),
    ]
    for checkpoint in checkpoints:  # each whole, as saved
        assert read_manifest(checkpoint.path)["step"] == checkpoint.step
    assert not (tmp_path / "latest").exists() and list((tmp_path / "project" / "checkpoints").iterdir()) == []
