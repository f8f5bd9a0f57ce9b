"""Checkpoint stall: how long training stops per save, Trainyard's save against a plain `accelerator.save_state`.

    PYTHONPATH=$PWD .venv/bin/python bench/checkpoint_stall.py [--steps 40] [--every 8] [--rounds 2]

Both sides train the same GPT (8 layers × 512: 25M parameters, ~290 MB of Accelerate state with
AdamW's moments) on Tiny Shakespeare on this machine's CPU, launched the same way (`accelerate
launch`, same thread count: `--threads`, all cores by default), checkpointing every `--every` steps:

- the peer, bench/plain_accelerate_loop.py, calls `accelerator.save_state(dir)`, synchronously;
- Trainyard runs the training entry point (`accelerate launch -m workers.training`, as a worker
  does, its events to a JSONL file), whose checkpoint also holds the unwrapped model.safetensors,
  JSON files and a manifest with the sha256 of every file.

Both measure the same way, from the step times each loop reports (wall time between optimizer
steps, so a save is paid for by the step after it): the **stall** of a save is the time of the step
after it minus the median step time away from saves; **lost** adds up the excess of the `--window`
steps after a save, which also counts what a background write takes from training by sharing the
CPU. Steps before `--skip` (warm-up) and the last save (nothing runs after it) are left out. For
Trainyard it also reports how many later steps' metrics came before each checkpoint's event. Rounds
alternate. Target: Trainyard's stall ≤ 10% of the peer's. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = {"n_layer": 8, "n_head": 8, "n_embd": 512, "block_size": 64, "dropout": 0.0}


def bench_spec(steps: int, every: int) -> dict:
    spec = json.loads((REPO / "examples" / "shakespeare-char.json").read_text())
    spec["model"].update(MODEL)
    spec["training"].update(max_steps=steps, micro_batch_size=8, eval_every=steps, eval_batches=1)
    spec["schedule"]["warmup_steps"] = 2
    spec["checkpoint"] = {"every_steps": every, "keep_last": 2}
    return spec


def launch(script: list[str], threads: int, env: dict | None = None) -> str:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--cpu", "--num_cpu_threads_per_process", str(threads), *script,
    ]
    environment = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    return subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO, env=environment).stdout


def run_peer(spec_file: Path, work: Path, every: int, threads: int) -> dict[int, float]:
    out = launch([
        str(REPO / "bench" / "plain_accelerate_loop.py"), "--spec", str(spec_file), "--data", str(REPO / "data" / "tinyshakespeare.txt"),
        "--skip", "1", "--checkpoint-every", str(every), "--checkpoint-dir", str(work),
    ], threads)
    return {int(step): t for step, t in json.loads(out.strip().splitlines()[-1])["step_times"].items()}


def run_trainyard(spec_file: Path, work: Path, threads: int) -> tuple[dict[int, float], dict[int, int]]:
    """Step times, and for each checkpoint: how many later steps' metrics were reported before it
    (0 for a save that blocks the loop until it is reported; metrics are reported one step late)."""
    events_file = work / "events.jsonl"
    work.mkdir(parents=True)
    launch(
        ["-m", "workers.training", "--spec", str(spec_file), "--data-root", str(REPO / "data"), "--run-dir", str(work)],
        threads, {"TRAINYARD_EVENTS_FILE": str(events_file)},
    )
    step_times, reported_after, last_step = {}, {}, 0
    for line in events_file.read_text().splitlines():
        event = json.loads(line)
        if event["type"] == "metrics":
            step_times[event["step"]] = event["values"]["step_time_s"]
            last_step = max(last_step, event["step"])
        else:
            reported_after[event["step"]] = last_step - event["step"]
    return step_times, reported_after


def stall(step_times: dict[int, float], every: int, skip: int, window: int) -> tuple[float, float]:
    """(median stall, median lost) per save, in seconds, as the module docstring defines them."""
    saves = [s for s in step_times if s % every == 0 and s >= skip and s + window in step_times]
    near = {s + k for s in saves for k in range(1, window + 1)}
    baseline = statistics.median(t for step, t in step_times.items() if step > skip and step not in near)
    stalls = [step_times[s + 1] - baseline for s in saves]
    lost = [sum(step_times[s + k] - baseline for k in range(1, window + 1)) for s in saves]
    return statistics.median(stalls), statistics.median(lost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--skip", type=int, default=4, help="warm-up steps left out")
    parser.add_argument("--window", type=int, default=3, help="steps after a save counted in `lost`")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of each training (fewer leaves a core free)")
    args = parser.parse_args()

    spec = bench_spec(args.steps, args.every)
    peer, trainyard, lags = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        for round_ in range(args.rounds):
            work = Path(tmp) / f"peer-{round_}"
            peer.append(stall(run_peer(spec_file, work, args.every, args.threads), args.every, args.skip, args.window))
            shutil.rmtree(work, ignore_errors=True)  # ~290 MB a save
            work = Path(tmp) / f"yard-{round_}"
            step_times, reported_after = run_trainyard(spec_file, work, args.threads)
            trainyard.append(stall(step_times, args.every, args.skip, args.window))
            lags.append(reported_after)
            shutil.rmtree(work, ignore_errors=True)

    peer_stall, yard_stall = statistics.median(s for s, _ in peer), statistics.median(s for s, _ in trainyard)
    peer_lost, yard_lost = statistics.median(w for _, w in peer), statistics.median(w for _, w in trainyard)
    print(json.dumps({
        "benchmark": "checkpoint_stall",
        "machine": f"{os.cpu_count()} CPU cores",
        "threads": args.threads,
        "model": {k: MODEL[k] for k in ("n_layer", "n_embd", "block_size")},
        "steps": args.steps,
        "every": args.every,
        "peer_stall_s": round(peer_stall, 3),
        "trainyard_stall_s": round(yard_stall, 3),
        "ratio": round(yard_stall / peer_stall, 3),
        "target_ratio": 0.1,
        f"peer_lost_s_over_{args.window}_steps": round(peer_lost, 3),
        f"trainyard_lost_s_over_{args.window}_steps": round(yard_lost, 3),
        "trainyard_checkpoint_reported_after_steps": lags,
        "rounds": {"peer": [[round(x, 3) for x in r] for r in peer], "trainyard": [[round(x, 3) for x in r] for r in trainyard]},
    }))


if __name__ == "__main__":
    main()
