"""Training throughput of a Trainyard job against a plain Accelerate loop, measured in the same run.

    .venv/bin/python bench/throughput.py [--steps 300] [--rounds 2]

Both train the README's example model (GPT 4×128, block 64, batch 12) on Tiny Shakespeare on this
machine's CPU, launched the same way (`accelerate launch`, same thread count). The peer is
bench/plain_accelerate_loop.py; the job runs through the embedded stack (API, scheduler, Celery
worker, supervisor, reporting). Both measure tokens/s between step `--skip` and the last step;
the rounds alternate so machine noise hits both alike. Prints one JSON line.
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
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from stack.embedded import embedded_stack  # noqa: E402
from workers.supervisor import free_port  # noqa: E402


# On a GPU, the example model is too small to load it; this one is GPT-2 small's shape.
GPU_MODEL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
GPU_BATCH = 16
H100_BF16_PEAK_FLOPS = 989e12  # dense, SXM


def bench_spec(steps: int, device: str, precision: str) -> dict:
    spec = json.loads((REPO / "examples" / "shakespeare-char.json").read_text())
    spec["training"].update(max_steps=steps, eval_every=steps, precision=precision)
    spec["checkpoint"] = {"every_steps": None, "keep_last": 1}
    spec["schedule"]["warmup_steps"] = 10
    spec["resources"]["device"] = device
    if device == "cuda":
        spec["training"].pop("compile")  # the GPU defaults: compiled, fused AdamW, TF32
        spec["model"].update(GPU_MODEL)
        spec["training"].update(micro_batch_size=GPU_BATCH, eval_batches=2)
    return spec


def flops_per_token(spec: dict, vocab_size: int = 65) -> float:
    """Training FLOPs per token, as nanoGPT's estimate_mfu: 6 × parameters + attention."""
    m = spec["model"]
    params = 12 * m["n_layer"] * m["n_embd"] ** 2 + (vocab_size + m["block_size"]) * m["n_embd"]
    return 6 * params + 12 * m["n_layer"] * m["block_size"] * m["n_embd"]


def run_peer(spec: dict, spec_file: Path, skip: int) -> float:
    device = ["--cpu", "--num_cpu_threads_per_process", str(os.cpu_count() or 1)] if spec["resources"]["device"] == "cpu" else []
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
        "--mixed_precision", spec["training"]["precision"], "--dynamo_backend", "no", *device,
        str(REPO / "bench" / "plain_accelerate_loop.py"), "--spec", str(spec_file), "--data", str(REPO / "data" / "tinyshakespeare.txt"),
        "--skip", str(skip),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def run_trainyard(spec: dict, skip: int, data_dir: Path) -> float:
    devices = "cuda:all" if spec["resources"]["device"] == "cuda" else None
    with embedded_stack(data_dir, free_port(), workers=1, devices=devices) as stack:
        client = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.token}"}, timeout=30)
        job_id = client.post("/v1/jobs", json=spec).json()["id"]
        while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(1)
        if job["status"] != "succeeded":
            raise SystemExit(f"the Trainyard job {job['status']}: {job['failure_reason']}")
        step_times = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "step_time_s"}).json()["series"]["step_time_s"]
    # step_time_s is wall time between consecutive steps: its sum after `skip` spans step skip → last.
    elapsed = sum(t for step, t in zip(step_times["steps"], step_times["values"]) if step > skip)
    training = spec["training"]
    tokens_per_step = training["micro_batch_size"] * training["gradient_accumulation_steps"] * spec["model"]["block_size"]
    return (training["max_steps"] - skip) * tokens_per_step / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps left out of the measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["no", "bf16", "fp16"], default="no")
    args = parser.parse_args()

    spec = bench_spec(args.steps, args.device, args.precision)
    peer, trainyard = [], []
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        for round_ in range(args.rounds):
            peer.append(run_peer(spec, spec_file, args.skip))
            trainyard.append(run_trainyard(spec, args.skip, Path(tmp) / f"yard-{round_}"))
    machine = f"{os.cpu_count()} CPU cores"
    if args.device == "cuda":
        import torch

        machine = torch.cuda.get_device_name(0)
    result = {
        "benchmark": "throughput",
        "machine": machine,
        "device": args.device,
        "precision": args.precision,
        "model": {k: spec["model"][k] for k in ("n_layer", "n_embd", "block_size")},
        "steps": args.steps,
        "peer_tokens_per_s": round(statistics.median(peer)),
        "trainyard_tokens_per_s": round(statistics.median(trainyard)),
        "ratio": round(statistics.median(trainyard) / statistics.median(peer), 3),
        **(
            {
                "mfu_peer": round(statistics.median(peer) * flops_per_token(spec) / H100_BF16_PEAK_FLOPS, 3),
                "mfu_trainyard": round(statistics.median(trainyard) * flops_per_token(spec) / H100_BF16_PEAK_FLOPS, 3),
            }
            if args.device == "cuda"
            else {}
        ),
        "rounds": {"peer": [round(x) for x in peer], "trainyard": [round(x) for x in trainyard]},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
