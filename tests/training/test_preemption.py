"""SIGTERM: checkpoint at the next step, exit 75, and the resumed job is the job that never stopped."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from api_schemas.manifest import MODEL_FILE, checkpoint_name, verify_manifest
from api_schemas.worker_protocol import EXIT_PREEMPTED
from tests.helpers import job_spec, tiny_spec
from tests.training.support import REPO, Collector, entry_point, read_events, reset_accelerate, subprocess_env
from workers.training import train

# Long enough that SIGTERM, sent as soon as the first metrics event appears, lands well before the end.
MAX_STEPS = 300


def metrics_of(events: list[dict]) -> dict[int, dict[str, float]]:
    return {e["step"]: e["values"] for e in events if e["type"] == "metrics"}


def test_sigterm_checkpoints_where_it_stops_exits_75_and_resuming_is_bit_identical(data_root, tmp_path):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(tiny_spec(**{
        "training.max_steps": MAX_STEPS, "training.eval_every": 100, "checkpoint.every_steps": None, "schedule.warmup_steps": 10,
    })))

    processes: list[subprocess.Popen] = []

    def start(name: str, resume_from: Path | None = None) -> tuple[subprocess.Popen, Path]:
        events = tmp_path / f"{name}.jsonl"
        process = subprocess.Popen(
            entry_point(spec_file, data_root, tmp_path / name, resume_from), cwd=REPO, env=subprocess_env(events),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        processes.append(process)
        return process, events

    try:
        straight, straight_events = start("straight")  # runs alongside, on the other core
        preempted, preempted_events = start("preempted")
        deadline = time.monotonic() + 240
        while not metrics_of(read_events(preempted_events)):
            assert preempted.poll() is None, preempted.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no metrics event"
            time.sleep(0.01)
        preempted.send_signal(signal.SIGTERM)
        _, stderr = preempted.communicate(timeout=240)
        assert preempted.returncode == EXIT_PREEMPTED, stderr[-3000:]
        assert "Traceback" not in stderr

        events = read_events(preempted_events)
        checkpoints = [e for e in events if e["type"] == "checkpoint"]
        stopped_at = max(metrics_of(events))
        assert len(checkpoints) == 1 and checkpoints[0]["step"] == stopped_at < MAX_STEPS
        assert sorted(metrics_of(events)) == list(range(1, stopped_at + 1))
        checkpoint = Path(checkpoints[0]["path"])
        verify_manifest(checkpoint)
        assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == stopped_at

        resumed, resumed_events = start("resumed", resume_from=checkpoint)
        _, stderr = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, stderr[-3000:]
        _, stderr = straight.communicate(timeout=300)
        assert straight.returncode == 0, stderr[-3000:]
    finally:
        for process in processes:  # only on failure is any still running
            if process.poll() is None:
                process.kill()
                process.communicate()

    straight_metrics, resumed_metrics = metrics_of(read_events(straight_events)), metrics_of(read_events(resumed_events))
    assert sorted(resumed_metrics) == list(range(stopped_at + 1, MAX_STEPS + 1))
    for step in resumed_metrics:
        assert resumed_metrics[step]["train_loss"] == straight_metrics[step]["train_loss"], f"step {step}"
        assert resumed_metrics[step]["lr"] == straight_metrics[step]["lr"], f"step {step}"
    final = f"checkpoints/{checkpoint_name(MAX_STEPS)}/{MODEL_FILE}"
    a, b = load_file(str(tmp_path / "resumed" / final)), load_file(str(tmp_path / "straight" / final))
    assert a.keys() == b.keys()
    assert [name for name in b if not torch.equal(a[name], b[name])] == []


def test_train_gives_back_the_sigterm_handler_it_found(data_root, tmp_path):
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        reset_accelerate()
        spec = job_spec(**{"training.max_steps": 1, "schedule.warmup_steps": 0, "checkpoint.every_steps": None})
        train(spec, data_root, tmp_path / "run", Collector())
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
        reset_accelerate()
