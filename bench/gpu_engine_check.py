"""On a CUDA machine: run the training entry point in each precision, and with torch.compile.

    python bench/gpu_engine_check.py

For each variant: exit code, final eval loss, seconds, and whether the saved weights load into a
fresh uncompiled GPT (no `_orig_mod.` prefix). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from safetensors.torch import load_file  # noqa: E402

from api_schemas import JobSpec  # noqa: E402
from api_schemas.worker_protocol import EVENTS_FILE_ENV  # noqa: E402
from workers.training import load_model, load_text_corpus  # noqa: E402

VARIANTS = {
    "fp32": {"precision": "no"},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "bf16+compile": {"precision": "bf16", "compile": True},
}


def run(name: str, overrides: dict, tmp: Path) -> dict:
    spec = json.loads((REPO / "examples" / "shakespeare-char.json").read_text())
    spec["training"].update(max_steps=300, eval_every=300, **overrides)
    spec["resources"]["device"] = "cuda"
    spec["checkpoint"] = {"every_steps": None, "keep_last": 1}
    run_dir = tmp / name
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps(spec))
    events = run_dir / "events.jsonl"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
        "--mixed_precision", overrides["precision"], "--dynamo_backend", "no",
        "-m", "workers.training", "--spec", str(run_dir / "spec.json"), "--data-root", str(REPO / "data"), "--run-dir", str(run_dir),
    ]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, EVENTS_FILE_ENV: str(events)})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        return {"exit": done.returncode, "error": done.stderr[-1500:]}
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    metrics = [e for e in lines if e["type"] == "metrics"]
    checkpoint = Path([e for e in lines if e["type"] == "checkpoint"][-1]["path"])
    keys = load_file(str(checkpoint / "model.safetensors")).keys()
    job_spec = JobSpec.model_validate(spec)
    load_model(job_spec, load_text_corpus(job_spec.dataset, REPO / "data").tokenizer.vocab_size, checkpoint / "model.safetensors")
    step_times = sorted(e["values"]["step_time_s"] for e in metrics[20:])
    return {
        "exit": 0,
        "seconds": round(seconds, 1),
        "median_step_ms": round(1000 * step_times[len(step_times) // 2], 2),
        "first_train_loss": round(metrics[0]["values"]["train_loss"], 4),
        "last_train_loss": round(metrics[-1]["values"]["train_loss"], 4),
        "eval_loss": round(metrics[-1]["values"]["eval_loss"], 4),
        "orig_mod_prefix_in_weights": any("_orig_mod" in k for k in keys),
        "loads_into_fresh_uncompiled_gpt": True,
    }


def main() -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, overrides, Path(tmp)) for name, overrides in VARIANTS.items()}
    print(json.dumps({"benchmark": "gpu_engine_check", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
