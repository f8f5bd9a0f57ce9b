"""`custom` jobs: the GAN example runs as a job through `python -m workers.training` (two models, two
optimizers, metrics, checkpoints holding both models, preemption and resume), and nothing outside the
plugin directory can be loaded as an entrypoint."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from api_schemas import JobSpec
from api_schemas.manifest import MODEL_FILE, verify_manifest
from api_schemas.worker_protocol import EXIT_PREEMPTED
from tests.training.support import REPO, Collector, entry_point, read_events, reset_accelerate, subprocess_env
from workers.launch import launch_command
from workers.supervisor import free_port
from workers.training.custom import run_custom

EXAMPLE = REPO / "examples" / "plugins" / "gan_example.py"
GAN_SPEC = json.loads((REPO / "examples" / "gan.json").read_text())


def gan_spec(max_steps: int, every_steps: int | None, **training) -> dict:
    return {
        **GAN_SPEC, "training": {"max_steps": max_steps, "micro_batch_size": 128, "seed": 0, **training},
        "checkpoint": {"every_steps": every_steps, "keep_last": 2},
    }


def gan_module():
    module_spec = importlib.util.spec_from_file_location("gan_example_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture
def plugin_dir(tmp_path) -> Path:
    directory = tmp_path / "plugins"
    directory.mkdir()
    shutil.copy(EXAMPLE, directory / EXAMPLE.name)
    return directory


def start(tmp_path: Path, name: str, spec: dict, plugin_dir: Path | None, resume_from: Path | None = None):
    spec_file, events = tmp_path / f"{name}-spec.json", tmp_path / f"{name}.jsonl"
    spec_file.write_text(json.dumps(spec))
    command = entry_point(spec_file, tmp_path / "data", tmp_path / name, resume_from)
    command += ["--plugin-dir", str(plugin_dir)] if plugin_dir else []
    process = subprocess.Popen(command, cwd=REPO, env=subprocess_env(events), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, events


def metrics_of(events: list[dict]) -> dict[int, dict[str, float]]:
    return {e["step"]: e["values"] for e in events if e["type"] == "metrics"}


def test_the_gan_example_trains_as_a_job_and_its_checkpoint_holds_both_models(tmp_path, plugin_dir):
    process, events_file = start(tmp_path, "gan", gan_spec(600, 300), plugin_dir)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]

    events = read_events(events_file)
    metrics = metrics_of(events)
    assert sorted(metrics) == list(range(1, 601)) and all(set(v) == {"d_loss", "g_loss"} for v in metrics.values())
    checkpoints = {e["step"]: Path(e["path"]) for e in events if e["type"] == "checkpoint"}
    assert sorted(checkpoints) == [300, 600]
    final = checkpoints[600]
    assert verify_manifest(final)["step"] == 600
    assert {p.name for p in final.iterdir()} == {MODEL_FILE, "state", "trainer_state.json", "spec.json", "manifest.json"}

    # Both models, by name, load strictly into fresh ones built from the spec's config.
    gan = gan_module()
    config = JobSpec.model_validate_json((final / "spec.json").read_text()).model.config
    generator, discriminator = gan.build_models(config)
    untrained = gan.mean_distance_to_ring(generator, config)
    weights = load_file(str(final / MODEL_FILE))
    for prefix, model in (("generator.", generator), ("discriminator.", discriminator)):
        model.load_state_dict({name.removeprefix(prefix): t for name, t in weights.items() if name.startswith(prefix)})
    assert len(weights) == len(generator.state_dict()) + len(discriminator.state_dict())
    # It learnt: generated points lie near the ring (measured: 0.21 after 600 steps, 1.9 untrained).
    assert untrained > 1.0 and gan.mean_distance_to_ring(generator, config) < 0.5


def test_a_preempted_gan_checkpoints_exits_75_and_resumes_bit_identical(tmp_path, plugin_dir):
    steps = 1500  # long enough that SIGTERM, sent on the first metrics event, lands well before the end
    spec = gan_spec(steps, None, micro_batch_size=16)
    process, events_file = start(tmp_path, "preempted", spec, plugin_dir)
    try:
        deadline = time.monotonic() + 120
        while not metrics_of(read_events(events_file)):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    events = read_events(events_file)
    [checkpoint] = [e for e in events if e["type"] == "checkpoint"]
    stopped_at = max(metrics_of(events))
    assert checkpoint["step"] == stopped_at < steps

    # The rest, resumed in-process, against the whole run straight through: the same weights, bit for bit.
    def run(run_dir: Path, resume_from: Path | None) -> Collector:
        collector = Collector()
        reset_accelerate()
        try:
            run_custom(JobSpec.model_validate(spec), tmp_path / "data", run_dir, collector, resume_from, plugin_dir)
        finally:
            reset_accelerate()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return collector

    torch.set_num_threads(1)  # as the subprocess (OMP_NUM_THREADS=1)
    resumed = run(tmp_path / "resumed", Path(checkpoint["path"]))
    straight = run(tmp_path / "straight", None)
    assert [s for s, _ in resumed.metrics_log] == list(range(stopped_at + 1, steps + 1))
    assert resumed.series("d_loss") == straight.series("d_loss")[stopped_at:]
    a, b = resumed.final_weights(), straight.final_weights()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_an_entrypoint_outside_the_plugin_directory_never_runs(tmp_path, plugin_dir):
    # A module that leaves a mark when imported, outside the plugin directory: in the data root, and
    # linked into the plugin directory.
    (tmp_path / "data").mkdir()
    marker = tmp_path / "ran"
    for place in (tmp_path / "data" / "evil.py", tmp_path / "elsewhere.py"):
        place.write_text(f"open({str(marker)!r}, 'w').close()\ndef train(ctx):\n    pass\n")
    (plugin_dir / "linked.py").symlink_to(tmp_path / "elsewhere.py")

    for entrypoint, directory in (("evil:train", plugin_dir), ("linked:train", plugin_dir), ("gan_example:train", None)):
        process, events_file = start(tmp_path, entrypoint.partition(":")[0], {**gan_spec(5, None), "model": {
            "kind": "custom", "entrypoint": entrypoint}}, directory)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2 and "model.entrypoint" in stderr and len(stderr.strip().splitlines()) == 1, stderr
        # No step, no checkpoint: only the refusal, told to the worker, which fails the job without retrying it.
        assert [(e["type"], "model.entrypoint" in e["message"]) for e in read_events(events_file)] == [("invalid_spec", True)]
        assert not marker.exists()


def test_the_gan_on_two_processes_reports_each_step_once_and_checkpoints_together(tmp_path, plugin_dir):
    spec = JobSpec.model_validate({**gan_spec(20, 10), "resources": {"processes_per_node": 2}})
    run_dir, events_file = tmp_path / "two", tmp_path / "two.jsonl"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(spec.model_dump_json())
    command = launch_command(spec, run_dir, tmp_path, None, f"127.0.0.1:{free_port()}", plugin_dir=plugin_dir)
    done = subprocess.run(command, cwd=REPO, env=subprocess_env(events_file), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    events = read_events(events_file)
    assert [e["step"] for e in events if e["type"] == "metrics"] == list(range(1, 21))  # the main process's, once
    checkpoints = [Path(e["path"]) for e in events if e["type"] == "checkpoint"]
    assert [verify_manifest(path)["step"] for path in checkpoints] == [10, 20]
    assert {name.split(".")[0] for name in load_file(str(checkpoints[-1] / MODEL_FILE))} == {"generator", "discriminator"}


SHARD_PLUGIN = '''
import json

from torch.utils.data import Dataset

from workers.training.data import TokenWindows


class Indices(Dataset):
    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return index


def train(ctx):
    windows = TokenWindows(ctx.dataset.train, 8)  # the job's corpus, as the context hands it over
    seen = [int(i) for batch in ctx.dataloader(Indices(len(windows))) for i in batch]
    rank = ctx.accelerator.process_index
    (ctx.run_dir / f"seen-{rank}.json").write_text(json.dumps({"windows": len(windows), "seen": seen}))
    ctx.log_metric(1, {"samples": len(seen)})
'''


def test_a_custom_loop_gets_the_jobs_corpus_and_a_dataloader_that_shards_it_across_processes(tmp_path, plugin_dir):
    (plugin_dir / "shards.py").write_text(SHARD_PLUGIN)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.txt").write_text("abcdefgh" * 500)
    spec = JobSpec.model_validate({
        "name": "shards", "model": {"kind": "custom", "entrypoint": "shards:train"},
        "dataset": {"kind": "text", "path": "corpus.txt", "val_fraction": 0.1},
        "training": {"max_steps": 1, "micro_batch_size": 16, "seed": 3}, "optimizer": {"name": "adamw", "lr": 0.001},
        "resources": {"processes_per_node": 2},
    })
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(spec.model_dump_json())
    command = launch_command(spec, run_dir, tmp_path / "data", None, f"127.0.0.1:{free_port()}", plugin_dir=plugin_dir)
    done = subprocess.run(command, cwd=REPO, env=subprocess_env(tmp_path / "events.jsonl"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = (json.loads((run_dir / f"seen-{rank}.json").read_text()) for rank in (0, 1))
    windows = first["windows"]  # 3,600 training characters: 449 windows of 8 (+1) tokens
    whole_rounds = windows // (16 * 2) * 16  # each process gets 16 per batch; the last, short round is dropped
    assert len(first["seen"]) == len(second["seen"]) == whole_rounds
    assert not set(first["seen"]) & set(second["seen"])  # a shard each: no window read twice
    assert first["seen"] != sorted(first["seen"])  # shuffled (by training.seed)
