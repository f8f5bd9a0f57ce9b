"""Job start: submit → first optimizer step, against a bare `accelerate launch` of the same training.

    PYTHONPATH=$PWD .venv/bin/python bench/job_start.py [--rounds 5]

The peer launches the training entry point directly (`accelerate launch -m workers.training`, the
command a worker runs) and times process start → the first step's line in its events file. The
Trainyard side is an embedded stack already running (`trainyard up`: API, scheduler, SQLite broker
and database, one worker): POST /v1/jobs → the first step seen through the API (`GET /v1/jobs/{id}`
shows step ≥ 1: the worker forwarded it over the worker protocol and it is stored), so the
difference is everything the service adds: the API, the scheduler's pass, the broker, the worker's
claim, its launch and its forwarding. It also times the same line in the attempt's events file,
which shows what the forwarding adds. One poller (every 10 ms) watches the files and the API. The job is the README example,
five steps. Trainyard runs twice: a worker keeping no warm interpreter (every attempt starts cold,
target: overhead ≤ 2 s over the peer) and one keeping one (workers/warm_pool.py; each round waits
until the worker's replacement interpreter has loaded, as a worker between jobs has; target:
submit → first step ≤ 1.0 s). Prints one JSON line.

`--sandbox-cost`: instead, the bare launch against the same launch in the attempt's sandbox, as the
worker makes it (workers/sandbox.py: inputs granted, bwrap, the cgroup entered). Target: ≤ 0.2 s added.
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
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api_schemas.worker_protocol import EVENTS_FILE_ENV  # noqa: E402
from stack.embedded import embedded_stack  # noqa: E402
from workers.launch import EVENTS_FILE_NAME, SPEC_FILE_NAME, attempt_dir  # noqa: E402
from workers.limits import AttemptLimits, available, limited  # noqa: E402
from workers.sandbox import MAX_OPEN_FILES, MAX_PROCESSES, AttemptView, prepare_attempt, sandbox_command  # noqa: E402
from workers.supervisor import free_port  # noqa: E402


def start_spec() -> dict:
    spec = json.loads((REPO / "examples" / "shakespeare-char.json").read_text())
    spec["training"].update(max_steps=5, eval_every=5, eval_batches=1)
    spec["checkpoint"] = {"every_steps": None, "keep_last": 1}
    spec["schedule"]["warmup_steps"] = 1
    return spec


def first_step_seen(events: Path, since: float, timeout: float = 120) -> float:
    """Seconds from `since` until `events` holds a metrics line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if '"type": "metrics"' in events.read_text():
                return time.perf_counter() - since
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    raise SystemExit(f"no step reported in {events} within {timeout:.0f} s")


def run_peer(spec_file: Path, run_dir: Path, sandboxed: bool = False) -> float:
    start = time.perf_counter()  # the sandbox's preparation counts
    run_dir.mkdir(parents=True)
    threads = str(os.cpu_count() or 1)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--cpu", "--num_cpu_threads_per_process", threads,
        "-m", "workers.training", "--spec", str(spec_file), "--data-root", str(REPO / "data"), "--run-dir", str(run_dir),
    ]
    env = {**os.environ, EVENTS_FILE_ENV: str(run_dir / "events.jsonl"), "PYTHONPATH": str(REPO)}
    limits = None
    if sandboxed:
        spec_copy = run_dir / SPEC_FILE_NAME
        spec_copy.write_text(spec_file.read_text())
        command[command.index(str(spec_file))] = str(spec_copy)
        view = AttemptView(run_dir, prepare_attempt(run_dir, [REPO / "data" / "tinyshakespeare.txt"]), (), host_network=False)
        limits = AttemptLimits.create(f"bench-{run_dir.name}", None, MAX_PROCESSES) if available() else None
        command = limited(sandbox_command(command, run_dir, view), MAX_OPEN_FILES, limits, None)
    process = subprocess.Popen(command, cwd=run_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = first_step_seen(run_dir / "events.jsonl", start)
    process.wait(120)
    if limits is not None:
        limits.remove()
    return seconds


def sandbox_cost(rounds: int) -> None:
    spec = start_spec()
    bare, sandboxed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        run_peer(spec_file, Path(tmp) / "warmup", sandboxed=True)
        for round_ in range(rounds):
            bare.append(run_peer(spec_file, Path(tmp) / f"bare-{round_}"))
            sandboxed.append(run_peer(spec_file, Path(tmp) / f"sandboxed-{round_}", sandboxed=True))
    print(json.dumps({
        "benchmark": "job_start_sandbox_cost",
        "machine": f"{os.cpu_count()} CPU cores",
        "bare_launch_to_first_step_s": round(statistics.median(bare), 3),
        "sandboxed_launch_to_first_step_s": round(statistics.median(sandboxed), 3),
        "added_s": round(statistics.median(sandboxed) - statistics.median(bare), 3),
        "target_added_s": 0.2,
        "rounds": {"bare": [round(x, 2) for x in bare], "sandboxed": [round(x, 2) for x in sandboxed]},
    }))


def first_step_through_the_api(client: httpx.Client, job_id: int, events: Path, since: float, timeout: float = 120) -> tuple[float, float]:
    """Seconds from `since` until the job's first step is seen through the API, and until it was in `events`."""
    in_file = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if in_file is None:
            try:
                if '"type": "metrics"' in events.read_text():
                    in_file = time.perf_counter() - since
            except FileNotFoundError:
                pass
        if client.get(f"/v1/jobs/{job_id}").json()["step"] >= 1:
            seen = time.perf_counter() - since
            return seen, in_file if in_file is not None else seen
        time.sleep(0.01)
    raise SystemExit(f"job {job_id}'s first step not seen through the API within {timeout:.0f} s")


def run_trainyard(client: httpx.Client, spec: dict, work_root: Path) -> tuple[float, dict[str, float]]:
    """(submit → first step seen through the API, where the time went: queued → placed → claimed by
    the worker → in the events file → through the API, in seconds)."""
    start = time.perf_counter()
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    seconds, in_file = first_step_through_the_api(client, job_id, attempt_dir(work_root, job_id, 1) / EVENTS_FILE_NAME, start)
    while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.2)  # the next round starts on an idle worker
    at = {key: datetime.fromisoformat(value) for key, value in [("queued", job["created_at"]), *[(k, job["attempts"][0][k]) for k in ("created_at", "started_at")]]}
    placed, claimed = (at["created_at"] - at["queued"]).total_seconds(), (at["started_at"] - at["created_at"]).total_seconds()
    return seconds, {
        "scheduler": placed, "broker_and_claim": claimed, "launch_to_first_step": in_file - placed - claimed,
        "forwarded_to_the_api": seconds - in_file,
    }


def warm_interpreter_ready(timeout: float = 120) -> None:
    """Until the worker's warm interpreter has loaded (workers/warm_pool.py): it is idle once its
    imports are done. Only for the warm rounds, so that each finds one ready, as a worker between
    jobs does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        warm = [p for p in psutil.Process().children(recursive=True) if _is_warm_interpreter(p)]
        if warm and all(p.cpu_percent(interval=0.3) < 2 for p in warm):
            return
        time.sleep(0.2)
    raise SystemExit("no warm interpreter became ready")


def _is_warm_interpreter(process: psutil.Process) -> bool:
    try:
        command = process.cmdline()
    except psutil.Error:
        return False
    return "workers.warm" in command and not command[0].endswith(("bwrap", "sh", "nice"))


def trainyard_rounds(spec: dict, data_dir: Path, rounds: int, warm: bool) -> tuple[list[float], list[dict[str, float]]]:
    """`rounds` jobs on an embedded stack whose worker keeps a warm interpreter, or none."""
    os.environ["TRAINYARD_WARM_INTERPRETERS"] = "1" if warm else "0"
    seconds, splits = [], []
    with embedded_stack(data_dir, free_port(), workers=1) as stack:
        client = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.token}"}, timeout=30)
        run_trainyard(client, spec, data_dir / "work")  # warm-up: page cache, the worker's first import
        for _ in range(rounds):
            if warm:
                warm_interpreter_ready()
            took, split = run_trainyard(client, spec, data_dir / "work")
            seconds.append(took)
            splits.append(split)
    return seconds, splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sandbox-cost", action="store_true", help="the sandbox's cost alone (see above)")
    args = parser.parse_args()
    if args.sandbox_cost:
        return sandbox_cost(args.rounds)

    spec = start_spec()
    peer = []
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        run_peer(spec_file, Path(tmp) / "peer-warmup")
        for round_ in range(args.rounds):
            peer.append(run_peer(spec_file, Path(tmp) / f"peer-{round_}"))
        cold, cold_splits = trainyard_rounds(spec, Path(tmp) / "cold", args.rounds, warm=False)
        warm, warm_splits = trainyard_rounds(spec, Path(tmp) / "warm", args.rounds, warm=True)

    def split(splits: list[dict[str, float]]) -> dict[str, float]:
        return {key: round(statistics.median(split[key] for split in splits), 2) for key in splits[0]}

    print(json.dumps({
        "benchmark": "job_start",
        "machine": f"{os.cpu_count()} CPU cores",
        "stack": "embedded (SQLite database and broker)",
        "peer_launch_to_first_step_s": round(statistics.median(peer), 2),
        "trainyard_cold_submit_to_first_step_s": round(statistics.median(cold), 2),
        "trainyard_warm_submit_to_first_step_s": round(statistics.median(warm), 2),
        "cold_overhead_s": round(statistics.median(cold) - statistics.median(peer), 2),
        "warm_over_peer": round(statistics.median(warm) / statistics.median(peer), 2),
        "targets": {"cold_overhead_s": 2.0, "warm_s": 1.0},
        "split_median_s": {"cold": split(cold_splits), "warm": split(warm_splits)},
        "rounds": {"peer": [round(x, 2) for x in peer], "cold": [round(x, 2) for x in cold], "warm": [round(x, 2) for x in warm]},
    }))


if __name__ == "__main__":
    main()
