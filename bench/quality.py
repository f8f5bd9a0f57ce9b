"""How well a Trainyard job learns, against a plain PyTorch loop that shares none of its code.

    .venv/bin/python bench/quality.py [--steps 2000] [--seeds 1337 1338 1339] [--model tie_embeddings=true ...]

Both train the README's example recipe (examples/shakespeare-char.json: nanoGPT's CPU "baby GPT",
4 layers × 4 heads × 128 wide, block 64, batch 12, AdamW lr 1e-3 wd 0.1 betas (0.9, 0.99), 100
warmup steps then cosine to 1e-4, gradient norm clipped at 1.0) for the same steps, once per seed:

- Trainyard: the job's spec run as a worker runs it (`python -m workers.training`, one process),
  its model, optimizer, schedule and data order all the project's own; `--model` overrides fields
  of the spec's `model` (to measure its options);
- the peer: the recipe written out below from scratch, nanoGPT's way: a GPT of torch's own layers
  (`nn.TransformerEncoderLayer`, pre-norm, GELU, separate output head, torch's default init),
  batches drawn at fresh random offsets, its own AdamW groups and learning-rate function.

One evaluator, also written below, scores every final model: the mean cross-entropy per token over
every non-overlapping window of the whole validation split (the last 10% of the text), not the
job's own `eval_loss`. Prints one JSON line: each side's runs, mean ± std, and the gap in the peer's
stds. Target: Trainyard's mean ≤ the peer's mean + 1 peer std.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api_schemas.worker_protocol import EVENTS_FILE_ENV  # noqa: E402
from workers.training import load_model_from_checkpoint  # noqa: E402

EXAMPLE = REPO / "examples" / "shakespeare-char.json"


# --- the peer: nothing below comes from the project ---------------------------------------------


class PlainGPT(nn.Module):
    """A small GPT from torch's building blocks: learned positions, pre-norm encoder layers run
    causally, a final norm and an output head of its own. Every layer keeps torch's default init."""

    def __init__(self, vocab: int, block: int, width: int, layers: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=dropout, activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=idx.device)
        x = self.drop(self.token(idx) + self.position(torch.arange(length, device=idx.device)))
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def peer_model(recipe: dict, train: torch.Tensor, vocab: int, seed: int, on_eval=None) -> nn.Module:
    """nanoGPT's train.py reduced to what the recipe uses, on the device `train` lies on (in bf16
    autocast where the recipe says so, on a GPU). `on_eval(step, model)` every `eval_every` steps."""
    m, t, o, s = recipe["model"], recipe["training"], recipe["optimizer"], recipe["schedule"]
    block, batch, steps = m["block_size"], t["micro_batch_size"], t["max_steps"]
    device = train.device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.get("precision") == "bf16" and device.type == "cuda")
    torch.manual_seed(seed)
    model = PlainGPT(vocab, block, m["n_embd"], m["n_layer"], m["n_head"], m.get("dropout", 0.0)).to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o["lr"], betas=tuple(o["betas"]),
    )

    def lr_at(step: int) -> float:  # linear warmup, then cosine down to min_lr at the last step
        warmup, peak, low = s["warmup_steps"], o["lr"], s["min_lr"]
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return low + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - low)

    offsets = torch.arange(block, device=device)
    for step in range(steps):
        starts = torch.randint(len(train) - block, (batch, 1), device=device)
        x, y = train[starts + offsets], train[starts + offsets + 1]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        with autocast:
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_eval is not None and ((step + 1) % t["eval_every"] == 0 or step + 1 == steps):
            on_eval(step + 1, model.eval())
            model.train()
    return model.eval()


@torch.no_grad()
def full_split_loss(logits_of, val: torch.Tensor, block: int, batch: int = 64) -> float:
    """Mean cross-entropy per token over every non-overlapping window of `val` (on `val`'s device;
    in bf16 autocast there when on a GPU, as both sides train)."""
    windows = (len(val) - 1) // block
    total = 0.0
    with torch.autocast(val.device.type, dtype=torch.bfloat16, enabled=val.device.type == "cuda"):
        for first in range(0, windows, batch):
            starts = range(first * block, min(windows, first + batch) * block, block)
            x = torch.stack([val[i : i + block] for i in starts])
            y = torch.stack([val[i + 1 : i + 1 + block] for i in starts])
            total += F.cross_entropy(logits_of(x).float().flatten(0, 1), y.flatten(), reduction="sum").item()
    return total / (windows * block)


# --- Trainyard: the job as a worker runs it ------------------------------------------------------


def trainyard_checkpoint(recipe: dict, scratch: Path) -> Path:
    """Run the spec with the loop exactly as a worker launches it; its last checkpoint's directory."""
    run_dir, spec_file = scratch / "run", scratch / "spec.json"
    spec_file.write_text(json.dumps(recipe))
    # One thread, as a worker runs a one-slot CPU job: two threads spin against whatever else runs.
    env = {**os.environ, EVENTS_FILE_ENV: str(scratch / "events.jsonl"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "workers.training", "--spec", str(spec_file), "--data-root", str(REPO / "data"), "--run-dir", str(run_dir)]
    subprocess.run(command, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return max((path.parent for path in run_dir.rglob("model.safetensors")), key=lambda path: path.name)


def parse_value(text: str):
    """A --model value as JSON (true, 0.1, null), else the word itself (pytorch)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    parser.add_argument("--model", nargs="*", default=[], metavar="FIELD=VALUE", help="override the job's model fields")
    parser.add_argument("--sides", nargs="+", choices=["trainyard", "peer"], default=["trainyard", "peer"])
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a worker runs a one-slot job; both sides alike

    recipe = json.loads(EXAMPLE.read_text())
    recipe["model"].update(dict((k, parse_value(v)) for k, v in (item.split("=", 1) for item in args.model)))
    recipe["training"].update(max_steps=args.steps, eval_every=args.steps)
    recipe["checkpoint"] = {"every_steps": args.steps, "keep_last": 1}
    recipe["schedule"]["warmup_steps"] = min(recipe["schedule"]["warmup_steps"], args.steps // 10)

    # The peer's own tokens: one id per distinct character, the last val_fraction held out.
    text = (REPO / "data" / recipe["dataset"]["path"]).read_text(encoding="utf-8")
    chars = sorted(set(text))
    ids = {c: i for i, c in enumerate(chars)}
    tokens = torch.tensor([ids[c] for c in text])
    split = int(len(tokens) * (1 - recipe["dataset"]["val_fraction"]))
    train, val, block = tokens[:split], tokens[split:], recipe["model"]["block_size"]

    results: dict[str, list[float]] = {side: [] for side in args.sides}
    started = time.perf_counter()
    for seed in args.seeds:
        recipe["training"]["seed"] = seed
        if "trainyard" in results:
            with tempfile.TemporaryDirectory() as scratch:
                model, tokenizer, _ = load_model_from_checkpoint(trainyard_checkpoint(recipe, Path(scratch)))
            assert tokenizer.chars == chars, "the job's vocabulary is not the evaluator's"
            results["trainyard"].append(full_split_loss(lambda x: model(x)[0], val, block))
        if "peer" in results:
            peer = peer_model(recipe, train, len(chars), seed)
            results["peer"].append(full_split_loss(peer, val, block))
        print(f"seed {seed}: " + ", ".join(f"{side} {runs[-1]:.4f}" for side, runs in results.items()), file=sys.stderr)

    line = {"benchmark": "quality", "steps": args.steps, "seeds": args.seeds, "model": recipe["model"]}
    for side, runs in results.items():
        line[f"{side}_runs"] = [round(v, 4) for v in runs]
        line[f"{side}_mean"] = round(statistics.mean(runs), 4)
        line[f"{side}_std"] = round(statistics.stdev(runs), 4) if len(runs) > 1 else None
    if len(results) == 2 and line["peer_std"]:
        line["gap_in_peer_stds"] = round((line["trainyard_mean"] - line["peer_mean"]) / line["peer_std"], 2)
        line["target"] = "trainyard_mean <= peer_mean + 1 peer std"
        line["met"] = line["trainyard_mean"] <= line["peer_mean"] + line["peer_std"]
    line["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
