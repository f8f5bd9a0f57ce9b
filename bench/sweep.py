"""Sweep: the same 16-trial search with ASHA pruning and without, in one run on one embedded stack.

    PYTHONPATH=$PWD .venv/bin/python bench/sweep.py [--trials 16] [--steps 600] [--concurrent 2]

A small char-GPT on Tiny Shakespeare (2×64, block 64, batch 12, CPU); the search space is the
learning rate (log-uniform 1e-4..3e-2) and the warm-up; a `random` sampler with one seed, so both
sweeps try the very same 16 specs. One sweep prunes with `asha` (first rung at a tenth of the
steps, reduction factor 3), the peer with `none`. Device-seconds: each trial attempt's running time
× its processes, from the API's attempts, start-up included. Best loss: the best finished trial's
last eval_loss. Target: ASHA ≤ 0.5× the device-seconds, its best loss within 1% of the full
search's. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from stack.embedded import embedded_stack  # noqa: E402
from workers.supervisor import free_port  # noqa: E402


def sweep_spec(pruner: str, trials: int, steps: int, concurrent: int) -> dict:
    base = json.loads((REPO / "examples" / "shakespeare-char.json").read_text())
    base["model"].update(n_layer=2, n_head=2, n_embd=64, block_size=64)
    base["training"].update(max_steps=steps, eval_every=steps // 20, eval_batches=8)
    base["checkpoint"] = {"every_steps": steps // 20, "keep_last": 1}
    base["schedule"].update(warmup_steps=steps // 20, min_lr=1e-5)
    rung = steps // 10
    return {
        "name": f"bench-{pruner}",
        "base": base,
        "search_space": {"optimizer.lr": {"log_uniform": [1e-4, 3e-2]}, "schedule.warmup_steps": {"int_range": [steps // 40, steps // 10]}},
        "sampler": {"kind": "random", "seed": 11},
        "objective": {"metric": "eval_loss", "direction": "min"},
        "budget": {"max_trials": trials, "max_concurrent": concurrent},
        "pruner": {"kind": pruner, "min_steps": rung, "reduction_factor": 3},
    }


def run_sweep(client: httpx.Client, spec: dict) -> dict:
    sweep = client.post("/v1/sweeps", json=spec).raise_for_status().json()
    while sweep["status"] == "running":
        time.sleep(2)
        sweep = client.get(f"/v1/sweeps/{sweep['id']}").raise_for_status().json()
    device_seconds = 0.0
    for trial in sweep["trials"]:
        job = client.get(f"/v1/jobs/{trial['job_id']}").raise_for_status().json()
        for attempt in job["attempts"]:  # one per node, each holding processes_per_node devices
            if attempt["started_at"] and attempt["finished_at"]:
                span = datetime.fromisoformat(attempt["finished_at"]) - datetime.fromisoformat(attempt["started_at"])
                device_seconds += span.total_seconds() * job["spec"]["resources"]["processes_per_node"]
    best = next((t for t in sweep["trials"] if t["number"] == sweep["best_trial"]), None)
    return {
        "status": sweep["status"],
        "device_seconds": round(device_seconds, 1),
        "best_eval_loss": best and round(best["value"], 4),
        "best_lr": best and best["params"]["optimizer.lr"],
        "pruned": sum(t["status"] == "pruned" for t in sweep["trials"]),
        "steps_trained": sum(t["step"] for t in sweep["trials"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--concurrent", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, embedded_stack(Path(tmp) / "yard", free_port(), workers=1) as stack:
        client = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.token}"}, timeout=30)
        asha = run_sweep(client, sweep_spec("asha", args.trials, args.steps, args.concurrent))
        full = run_sweep(client, sweep_spec("none", args.trials, args.steps, args.concurrent))
    print(json.dumps({
        "bench": "sweep", "trials": args.trials, "steps": args.steps, "concurrent": args.concurrent,
        "asha": asha, "none": full,
        "device_seconds_ratio": round(asha["device_seconds"] / full["device_seconds"], 3),
        "best_loss_gap": round(asha["best_eval_loss"] / full["best_eval_loss"] - 1, 4),
    }))


if __name__ == "__main__":
    main()
