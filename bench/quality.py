"""How well the Trainyard loop learns, against a plain nanoGPT-style loop, in the same run.

    .venv/bin/python bench/quality.py [--steps 2000] [--seeds 1337 1338 1339]

Both train the README's example job (examples/shakespeare-char.json: nanoGPT's CPU "baby GPT",
4 × 4 × 128, block 64, batch 12, AdamW lr 1e-3 wd 0.1 β2 0.99, 100 warmup steps and cosine to
1e-4, clip 1.0) for the same number of steps, once per seed:

- Trainyard: the training loop as a worker runs it (`python -m workers.training`, one process);
- the peer: nanoGPT's loop, written out below: every batch drawn at fresh random offsets
  (`get_batch`), the same GPT module, the same optimizer groups and schedule.

Each final model is then scored the same way: the mean loss over every window of the whole
validation split (not the loop's `eval_batches` sample). Prints one JSON line: each side's mean
over the seeds and their difference. Target: Trainyard's mean ≤ the peer's.
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

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api_schemas import JobSpec  # noqa: E402
from api_schemas.worker_protocol import EVENTS_FILE_ENV  # noqa: E402
from workers.training import GPT, eval_dataloader, evaluate, load_model, load_text_corpus, lr_at  # noqa: E402
from workers.training.loop import make_optimizer  # noqa: E402


def example_spec(steps: int, seed: int, windows: str) -> JobSpec:
    spec = json.loads((REPO / "examples" / "shakespeare-char.json").read_text())
    spec["dataset"]["windows"] = windows
    spec["training"].update(max_steps=steps, seed=seed, eval_every=steps, eval_batches=None)
    spec["checkpoint"] = {"every_steps": steps, "keep_last": 1}
    if spec["schedule"]["warmup_steps"] >= steps:
        spec["schedule"]["warmup_steps"] = steps // 10
    return JobSpec.model_validate(spec)


def trainyard_model(spec: JobSpec, data_root: Path, vocab_size: int) -> torch.nn.Module:
    """The loop exactly as a worker launches it, one process; its last checkpoint's weights."""
    with tempfile.TemporaryDirectory() as scratch:
        run_dir, spec_file = Path(scratch) / "run", Path(scratch) / "spec.json"
        spec_file.write_text(spec.model_dump_json())
        env = {**os.environ, EVENTS_FILE_ENV: str(Path(scratch) / "events.jsonl")}
        command = [sys.executable, "-m", "workers.training", "--spec", str(spec_file), "--data-root", str(data_root), "--run-dir", str(run_dir)]
        subprocess.run(command, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
        weights = max(run_dir.rglob("model.safetensors"), key=lambda path: path.parent.name)
        return load_model(spec, vocab_size, weights)


def peer_model(spec: JobSpec, train_tokens: torch.Tensor, vocab_size: int) -> torch.nn.Module:
    """nanoGPT's train.py on CPU, reduced to what this recipe uses."""
    cfg, block = spec.training, spec.model.block_size
    torch.manual_seed(cfg.seed)
    model = GPT(spec.model, vocab_size).train()
    optimizer = make_optimizer(model, spec)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(train_tokens) - block, (cfg.micro_batch_size,))
        x = torch.stack([train_tokens[i : i + block] for i in starts])
        y = torch.stack([train_tokens[i + 1 : i + 1 + block] for i in starts])
        return x, y

    for step in range(cfg.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        _, loss = model(*get_batch())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    parser.add_argument("--windows", choices=["random", "aligned"], default="random", help="the job's dataset.windows (aligned: as before)")
    args = parser.parse_args()

    data_root = REPO / "data"
    results: dict[str, list[float]] = {"trainyard": [], "peer": []}
    started = time.perf_counter()
    for seed in args.seeds:
        spec = example_spec(args.steps, seed, args.windows)
        corpus = load_text_corpus(spec.dataset, data_root)
        validation = eval_dataloader(corpus.val, spec)  # every validation window, eval_batches is null
        vocab = corpus.tokenizer.vocab_size
        results["trainyard"].append(evaluate(trainyard_model(spec, data_root, vocab), validation))
        results["peer"].append(evaluate(peer_model(spec, corpus.train, vocab), validation))
        print(f"seed {seed}: trainyard {results['trainyard'][-1]:.4f}, peer {results['peer'][-1]:.4f}", file=sys.stderr)
    trainyard, peer = statistics.mean(results["trainyard"]), statistics.mean(results["peer"])
    print(json.dumps({
        "benchmark": "quality", "steps": args.steps, "windows": args.windows, "seeds": args.seeds,
        "trainyard_val_loss": round(trainyard, 4), "peer_val_loss": round(peer, 4),
        "trainyard_runs": [round(v, 4) for v in results["trainyard"]], "peer_runs": [round(v, 4) for v in results["peer"]],
        "difference": round(trainyard - peer, 4), "target": "trainyard_val_loss <= peer_val_loss",
        "met": trainyard <= peer, "seconds": round(time.perf_counter() - started, 1),
    }))


if __name__ == "__main__":
    main()
