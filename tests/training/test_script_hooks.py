"""What a `script` job's own Accelerate code gets from Trainyard's sitecustomize, in a real process
with the environment the worker gives it (workers.launch.script_environment)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

from api_schemas import JobSpec
from api_schemas.manifest import verify_manifest
from workers.launch import script_environment

SPEC = JobSpec.model_validate({"name": "s", "script": {"entrypoint": "train.py", "code": {"path": "p"}}})


def run_script(tmp_path: Path, body: str, stderr: list[str] | None = None) -> list[dict]:
    """Run `body` as a script in tmp_path/code with a script job's environment; returns its events
    (and appends its stderr to `stderr`, if given)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(textwrap.dedent(body))
    env = {**script_environment(SPEC, tmp_path, None), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "train.py"], cwd=code, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if stderr is not None:
        stderr.append(done.stderr)
    events = tmp_path / "events.jsonl"
    return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []


def test_accelerator_log_reaches_the_events_file_with_no_tracker_configured(tmp_path):
    events = run_script(tmp_path, """
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        accelerator.log({"loss": 2.5, "lr": 1e-3}, step=1)
        accelerator.log({"loss": 2.0, "note": "text", "done": True, "bad": float("nan")})  # no step: the next one
        accelerator.init_trackers("project", config={"lr": 1e-3})  # with trackers set up later, still once per call
        accelerator.log({"loss": 1.5}, step=10)
        accelerator.end_training()
    """)
    # A bool is a number, text is not; a NaN is passed on (the worker's loss guard watches for one).
    assert math.isnan(events[1]["values"].pop("bad"))
    assert events == [
        {"type": "metrics", "step": 1, "values": {"loss": 2.5, "lr": 1e-3}},
        {"type": "metrics", "step": 2, "values": {"loss": 2.0, "done": 1.0}},
        {"type": "metrics", "step": 10, "values": {"loss": 1.5}},
    ]


def test_save_state_is_reported_as_a_checkpoint_with_a_manifest_at_the_last_logged_step(tmp_path):
    events = run_script(tmp_path, """
        import torch
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Linear(2, 2))
        accelerator.save_state("early_7")  # nothing logged yet: numbered by the folder's name
        accelerator.log({"loss": 1.0}, step=12)
        accelerator.save_state("ckpt/latest")
    """)
    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    handed_over = tmp_path / "checkpoints" / ".handed-over"  # moved there as save_state returned
    assert [(e["step"], Path(e["path"])) for e in checkpoints] == [
        (7, handed_over / "0" / "early_7"), (12, handed_over / "1" / "latest"),
    ]
    assert not (tmp_path / "code" / "early_7").exists() and not (tmp_path / "code" / "ckpt" / "latest").exists()
    assert "model.safetensors" in verify_manifest(Path(checkpoints[-1]["path"]))["files"]


def test_automatic_checkpoint_naming_saves_under_the_jobs_checkpoint_dir(tmp_path):
    events = run_script(tmp_path, """
        import torch
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration
        accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
        accelerator.prepare(torch.nn.Linear(2, 2))
        for step in (1, 2):
            accelerator.log({"loss": 1.0 / step}, step=step)
            accelerator.save_state()
    """)
    checkpoints = [(e["step"], e["path"]) for e in events if e["type"] == "checkpoint"]
    # TRAINYARD_CHECKPOINT_DIR is the project_dir: Accelerate saved under its checkpoints/, and each
    # save was handed over from there as it returned.
    assert list((tmp_path / "checkpoints" / "checkpoints").iterdir()) == []
    handed_over = tmp_path / "checkpoints" / ".handed-over"
    # Numbered by the folder's name (Accelerate's save iteration), as every named checkpoint is.
    assert checkpoints == [(0, str(handed_over / "0" / "checkpoint_0")), (1, str(handed_over / "1" / "checkpoint_1"))]


def test_log_with_all_and_no_tracker_installed_is_no_warning_under_trainyard(tmp_path):
    # Every such job's log said "`log_with=all` was passed but no supported trackers are currently installed".
    stderr: list[str] = []
    events = run_script(tmp_path, """
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True, log_with="all")
        accelerator.init_trackers("project")
        accelerator.log({"loss": 2.5}, step=1)
    """, stderr)
    assert events == [{"type": "metrics", "step": 1, "values": {"loss": 2.5}}]
    assert "no supported trackers" not in stderr[0], stderr[0]
