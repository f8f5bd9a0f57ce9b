"""The loss guard: what watching every step costs, and how soon a spiked job trains again.

    PYTHONPATH=$PWD .venv/bin/python bench/guard.py [--steps 300] [--rounds 3]

Cost: the README's example job (GPT 4×128, block 64, batch 12, Tiny Shakespeare, CPU) through the
training entry point (`accelerate launch -m workers.training`, as a worker launches it), with
`training.guard.enabled` true and false, the rounds alternating so the machine's noise hits both
alike; tokens/s from the steps' own times past the first 20. Target: ≤ 1% slower.

Rollback: a classifier whose data has a poisoned window (tests/helpers.py write_poisoned_labels)
through the embedded stack: from the spiked attempt's end to its next attempt's start (queued,
placed, claimed) and to the job's first step after the resume point, as the API shows them.
Reported, no target. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api_schemas.worker_protocol import EVENTS_FILE_ENV, decode_events  # noqa: E402
from stack.embedded import embedded_stack  # noqa: E402
from tests.helpers import guarded_classifier_spec, write_poisoned_labels  # noqa: E402
from workers.supervisor import free_port  # noqa: E402

SKIP = 20


def tokens_per_s(steps: int, guard: bool, work: Path) -> float:
    spec = json.loads((REPO / "examples" / "shakespeare-char.json").read_text())
    spec["training"].update(max_steps=steps, eval_every=steps, guard={"enabled": guard})
    spec["checkpoint"] = {"every_steps": None, "keep_last": 1}
    spec["dataset"]["path"] = "tinyshakespeare.txt"
    run = work / f"run-{guard}-{time.monotonic_ns()}"
    run.mkdir()
    (run / "spec.json").write_text(json.dumps(spec))
    events = run / "events.jsonl"
    env = {**os.environ, EVENTS_FILE_ENV: str(events), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_cpu_threads_per_process",
               str(os.cpu_count() or 1), "-m", "workers.training", "--spec", str(run / "spec.json"), "--data-root", str(work), "--run-dir", str(run)]
    subprocess.run(command, env=env, check=True, capture_output=True)
    decoded, _ = decode_events(events.read_bytes())
    times = [e.values["step_time_s"] for e in decoded if e.type == "metrics" and e.step > SKIP]
    tokens = spec["training"]["micro_batch_size"] * spec["model"]["block_size"]
    return tokens / statistics.mean(times)


def rollback_seconds() -> dict:
    with tempfile.TemporaryDirectory() as tmp, embedded_stack(Path(tmp) / "yard", free_port(), workers=1) as info:
        write_poisoned_labels(info.data_dir / "data", range(31, 34), batch=8)
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            # 100 steps: within one epoch (120 batches), as the poisoned rows come back in the next.
            job_id = client.post("/v1/jobs", json=guarded_classifier_spec("poisoned.jsonl", steps=100)).json()["id"]
            first_new_step_seen = None
            while True:
                job = client.get(f"/v1/jobs/{job_id}").json()
                # The resumed attempt claimed (the job's step set back to 30) and reporting steps past it.
                resumed = job["attempts"][1:] and job["attempts"][1]["started_at"] is not None
                if first_new_step_seen is None and resumed and job["status"] == "running" and job["step"] > 30:
                    first_new_step_seen = datetime.now().astimezone()
                if job["status"] in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.05)
            spiked, resumed = job["attempts"][:2]
            ended = datetime.fromisoformat(spiked["finished_at"])
            return {
                "status": job["status"], "rollbacks": job["rollbacks"],
                "to_next_attempt_s": round((datetime.fromisoformat(resumed["started_at"]) - ended).total_seconds(), 2),
                "to_training_again_s": round((first_new_step_seen - ended).total_seconds(), 2),
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "tinyshakespeare.txt").write_text((REPO / "data" / "tinyshakespeare.txt").read_text())  # the repository's copy
        on, off = [], []
        for _ in range(args.rounds):
            off.append(tokens_per_s(args.steps, False, work))
            on.append(tokens_per_s(args.steps, True, work))
    with_guard, without = statistics.median(on), statistics.median(off)
    print(json.dumps({
        "bench": "guard", "steps": args.steps, "rounds": args.rounds,
        "tokens_per_s_with_guard": round(with_guard), "tokens_per_s_without": round(without), "ratio": round(with_guard / without, 4),
        "target_ratio": 0.99, "rollback": rollback_seconds(),
    }))


if __name__ == "__main__":
    main()
