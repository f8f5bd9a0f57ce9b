"""A Slurm pool's start and hand-off: submit → first step through the pool, against a bare `sbatch`
of the same `accelerate launch`; and how fast queued jobs are handed to Slurm.

    PYTHONPATH=$PWD .venv/bin/python bench/slurm_start.py [--rounds 3] [--jobs 200]

Both sides run on a throwaway Slurm cluster on this machine (tests/slurm_cluster.py: slurmctld and
two slurmd nodes of 2 CPUs, loopback), one after the other in each round:

- the peer: `sbatch` of a batch script whose one task is `srun accelerate launch -m workers.training`
  on the README example (5 steps), timed from the `sbatch` call to the first step's line in its
  events file;
- Trainyard: the same spec with `resources.pool: slurm`, POSTed to an embedded stack whose
  scheduler hands it to the partition (no worker host of its own), timed from the POST to the first
  step seen through the API (`GET /v1/jobs/{id}` shows step ≥ 1): the scheduler's pass, its
  `sbatch`, the agent's start on the node, its claim over the worker protocol, the sandbox, the
  launch (a one-node CPU try's: in the interpreter the agent started loading torch in as it
  started, workers/warm_pool.py), and the forwarding. Target: ≤ 1.2× the peer's median.

Then `--jobs` jobs are POSTed at once into the 2-node partition and timed until every one has a
Slurm job id (handed: `sbatch` returned and the id is stored): jobs handed to Slurm per second. They
are cancelled after (each an `scancel`). Prints one JSON line.
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

from api_schemas.worker_protocol import EVENTS_FILE_ENV  # noqa: E402
from bench.job_start import first_step_seen, start_spec  # noqa: E402
from stack.embedded import embedded_stack  # noqa: E402
from tests.slurm_cluster import SlurmCluster  # noqa: E402
from workers.supervisor import free_port  # noqa: E402

FINAL = ("succeeded", "failed", "cancelled")


def run_peer(cluster: SlurmCluster, spec_file: Path, run_dir: Path) -> float:
    """sbatch → the first step in the events file, for the bare launch."""
    run_dir.mkdir(parents=True)
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--cpu", "--num_cpu_threads_per_process", "1",
        "-m", "workers.training", "--spec", str(spec_file), "--data-root", str(REPO / "data"), "--run-dir", str(run_dir),
    ]
    script = "\n".join([
        "#!/bin/bash", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=1", f"#SBATCH --output={run_dir}/slurm.out",
        f"export {EVENTS_FILE_ENV}={run_dir}/events.jsonl PYTHONPATH={REPO}", f"cd {run_dir}",
        "exec srun " + " ".join(launch), "",
    ])
    start = time.perf_counter()
    subprocess.run(["sbatch", "--parsable"], input=script, text=True, env=cluster.env, check=True, capture_output=True)
    seconds = first_step_seen(run_dir / "events.jsonl", start)
    while subprocess.run(["squeue", "--noheader"], env=cluster.env, capture_output=True, text=True).stdout.strip():
        time.sleep(0.2)  # the next round starts on idle nodes
    return seconds


def run_trainyard(client: httpx.Client, spec: dict) -> tuple[float, dict[str, float]]:
    """POST → the first step seen through the API, for the same job in the Slurm pool; and where the
    time went: POST → placed by the scheduler → claimed by the agent on the node (sbatch, Slurm's
    start of the step, the agent's start) → the first step seen (the sandbox, the launch, the
    training's start, the forwarding)."""
    posted_at = time.time()
    start = time.perf_counter()
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    deadline = time.monotonic() + 180
    while client.get(f"/v1/jobs/{job_id}").json()["step"] < 1:
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id}'s first step not seen through the API within 180 s: {client.get(f'/v1/jobs/{job_id}').json()}")
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in FINAL:
        time.sleep(0.2)
    if job["status"] != "succeeded":
        raise SystemExit(f"job {job_id} ended {job['status']}: {job['failure_reason']}")
    attempt = job["attempts"][0]
    placed, claimed = (datetime.fromisoformat(attempt[key]).timestamp() - posted_at for key in ("created_at", "started_at"))
    return seconds, {"placed": round(placed, 2), "claimed": round(claimed, 2), "first_step_seen": round(seconds, 2)}


def hand_off(client: httpx.Client, spec: dict, jobs: int) -> tuple[float, float]:
    """(seconds to POST `jobs` jobs, seconds from the first POST until every one has a Slurm job id)."""
    spec = {**spec, "training": {**spec["training"], "max_steps": 1000}}
    start = time.perf_counter()
    ids = [client.post("/v1/jobs", json={**spec, "name": f"handoff-{n}"}).json()["id"] for n in range(jobs)]
    posted = time.perf_counter() - start
    deadline = time.monotonic() + 600
    while True:
        handed = sum(1 for job in listed_jobs(client) if job["id"] in ids and job["attempts"] and job["attempts"][0]["cluster_job_id"])
        if handed == jobs:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"only {handed} of {jobs} jobs handed to Slurm within 600 s")
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    for job_id in ids:
        client.post(f"/v1/jobs/{job_id}/cancel")
    return posted, seconds


def listed_jobs(client: httpx.Client) -> list[dict]:
    """Every job the caller sees, page by page."""
    jobs, cursor = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 100, **({"cursor": cursor} if cursor else {})}).json()
        jobs += page["items"]
        if not (cursor := page["next_cursor"]):
            return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=200)
    args = parser.parse_args()

    spec = start_spec()
    cluster = SlurmCluster.start_new()
    saved = dict(os.environ)
    os.environ.update({"SLURM_CONF": str(cluster.conf), "TRAINYARD_SLURM_PARTITION": "batch", "TRAINYARD_MAX_ACTIVE_JOBS_PER_USER": str(args.jobs + 10)})
    peer, trainyard, splits = [], [], []
    try:
        with tempfile.TemporaryDirectory(dir=cluster.directory) as scratch, embedded_stack(Path(scratch) / "yard", free_port(), workers=0) as stack:
            client = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.token}"}, timeout=60)
            while not client.get("/v1/pools").json():  # the scheduler describes the partition as it starts
                time.sleep(0.2)
            spec_file = Path(scratch) / "spec.json"
            spec_file.write_text(json.dumps(spec))
            pooled = {**spec, "resources": {**spec["resources"], "pool": "slurm"}}
            run_peer(cluster, spec_file, Path(scratch) / "warmup")  # page cache, the nodes' first job
            for round_ in range(args.rounds):
                peer.append(run_peer(cluster, spec_file, Path(scratch) / f"peer-{round_}"))
                took, split = run_trainyard(client, pooled)
                trainyard.append(took)
                splits.append(split)
            posted, handed = hand_off(client, pooled, args.jobs)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        cluster.stop()

    ratio = statistics.median(trainyard) / statistics.median(peer)
    print(json.dumps({
        "benchmark": "slurm_start",
        "machine": f"{os.cpu_count()} CPU cores, Slurm with 2 nodes of 2 CPUs on it",
        "peer_sbatch_to_first_step_s": round(statistics.median(peer), 3),
        "trainyard_submit_to_first_step_s": round(statistics.median(trainyard), 3),
        "ratio": round(ratio, 3), "target_ratio": 1.2, "met": ratio <= 1.2,
        "rounds": {"peer": [round(x, 2) for x in peer], "trainyard": [round(x, 2) for x in trainyard]},
        "trainyard_split_s": splits,
        "jobs_handed": args.jobs, "posting_s": round(posted, 2), "handed_in_s": round(handed, 2),
        "jobs_handed_per_s": round(args.jobs / handed, 1),
    }))


if __name__ == "__main__":
    main()
