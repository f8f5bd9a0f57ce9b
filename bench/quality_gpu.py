"""How well a Trainyard job learns on a GPU: nanoGPT's own recipes, against nanoGPT's published
figures and bench/quality.py's plain loop on the same GPU (issue #43; a report, not a test).

    PYTHONPATH=$PWD python bench/quality_gpu.py [--only char,gpt2] [--seeds 1337 1338] [--budget-s 480] [--out FILE]

- char: nanoGPT's `config/train_shakespeare_char.py` (6 layers × 6 heads × 384, block 256, batch
  64, dropout 0.2, AdamW 1e-3, betas (0.9, 0.99), wd 0.1, 100 warmup steps, cosine to 1e-4 at
  5,000 steps, clip 1.0, bf16, compiled). nanoGPT's README: "on one A100 GPU this training run
  takes about 3 minutes and the best validation loss is 1.4697".
- gpt2: GPT-2 small's shape (12 × 12 × 768, block 1024, dropout 0, AdamW 6e-4, betas (0.9,
  0.95), wd 0.1, clip 1.0: nanoGPT's `train_gpt2.py` settings, warmup and steps scaled down) on
  Tiny Shakespeare tokenised by a byte-level BPE (GPT-2's algorithm and pre-tokenizer, learned here
  from the training split, since GPT-2's own merges can't be fetched on these machines; about 3.5
  characters a token, like GPT-2's on this text). nanoGPT publishes no from-scratch curve for this
  corpus, only the shape to expect of 124M parameters on ~300k tokens: the validation loss falls
  for the first few epochs, bottoms out and climbs as the model memorises (its finetuning config
  evaluates every 5 iterations for that reason). What is compared is that shape, side by side.

Each recipe runs as the job (the training entry point as a worker launches it, `accelerate launch
-m workers.training`, its evaluation over the whole validation split every `eval_every` steps) and
as bench/quality.py's peer (torch's own layers, its own AdamW groups and schedule, random windows,
eager bf16 autocast), one seed at a time. Both curves come from whole-split evaluations; the final
models are also scored by quality.py's one evaluator. One JSON line per run (and per recipe a
summary), each also appended to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from quality import full_split_loss, parse_value, peer_model  # noqa: E402

from workers.training import load_model_from_checkpoint  # noqa: E402

NANOGPT_CHAR_BEST_VAL = 1.4697  # nanoGPT README, shakespeare_char on one A100
BPE_FILE = "bpe-shakespeare.json"
RECIPES = {
    "char": {
        "model": {"kind": "gpt", "n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "dropout": 0.2},
        "dataset": {"kind": "text", "path": "tinyshakespeare.txt", "tokenizer": "char", "val_fraction": 0.1},
        "training": {"max_steps": 5000, "micro_batch_size": 64, "precision": "bf16", "grad_clip_norm": 1.0,
                     "eval_every": 250, "eval_batches": None},
        "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.99]},
        "schedule": {"name": "cosine", "warmup_steps": 100, "min_lr": 1e-4},
    },
    "gpt2": {
        "model": {"kind": "gpt", "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "dropout": 0.0},
        "dataset": {"kind": "text", "path": "tinyshakespeare.txt", "tokenizer_file": BPE_FILE, "val_fraction": 0.1},
        "training": {"max_steps": 300, "micro_batch_size": 16, "precision": "bf16", "grad_clip_norm": 1.0,
                     "eval_every": 20, "eval_batches": None},
        "optimizer": {"name": "adamw", "lr": 6e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        "schedule": {"name": "cosine", "warmup_steps": 30, "min_lr": 6e-5},
    },
}


def job_spec(name: str, seed: int, steps: int | None, device: str, model: dict) -> dict:
    recipe = json.loads(json.dumps(RECIPES[name]))
    recipe["model"].update(model)
    training = recipe["training"]
    if steps:  # a shorter run (the CPU smoke test of this script)
        training.update(max_steps=steps, eval_every=max(1, steps // 2))
        recipe["schedule"]["warmup_steps"] = max(1, steps // 10)
    training["seed"] = seed
    if device == "cpu":
        training["precision"] = "no"
    return {
        "name": f"quality-{name}", **recipe,
        "resources": {"nodes": 1, "processes_per_node": 1, "device": device},
        "checkpoint": {"every_steps": training["max_steps"], "keep_last": 1},
    }


def build_bpe(text: str, path: Path, vocab_size: int) -> None:
    """GPT-2's kind of tokenizer (byte-level BPE, its pre-tokenizer), learned from `text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.save(str(path))


def run_job(spec: dict, scratch: Path, data_root: Path, env: dict) -> dict:
    """The entry point as a worker launches it; its eval curve and its final checkpoint's directory."""
    run_dir = scratch / f"{spec['name']}-{spec['training']['seed']}"
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    events = run_dir / "events.jsonl"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
        "--mixed_precision", spec["training"]["precision"], "--dynamo_backend", "no", "-m", "workers.training",
        "--spec", str(run_dir / "spec.json"), "--data-root", str(data_root), "--run-dir", str(run_dir),
    ]
    started = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        code = subprocess.run(command, cwd=REPO, env={**env, "TRAINYARD_EVENTS_FILE": str(events)}, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{run_dir.name}: exit {code}: {(run_dir / 'log.txt').read_text()[-3000:]}")
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    curve = {e["step"]: round(e["values"]["eval_loss"], 4) for e in lines if e["type"] == "metrics" and "eval_loss" in e["values"]}
    last = Path([e for e in lines if e["type"] == "checkpoint"][-1]["path"])
    checkpoint = next(path.parent for path in [last / "model.safetensors", *last.rglob("model.safetensors")] if path.exists())
    return {"curve": curve, "checkpoint": checkpoint, "seconds": round(time.perf_counter() - started, 1)}


def corpus_tokens(spec: dict, data_root: Path, device: str) -> tuple[torch.Tensor, torch.Tensor, int, object]:
    """The bench's own tokens of the corpus (char ids, or the BPE file's), split as the spec says."""
    text = (data_root / spec["dataset"]["path"]).read_text(encoding="utf-8")
    if spec["dataset"].get("tokenizer_file"):
        from tokenizers import Tokenizer

        bpe = Tokenizer.from_file(str(data_root / spec["dataset"]["tokenizer_file"]))
        ids, vocab, vocabulary = bpe.encode(text, add_special_tokens=False).ids, bpe.get_vocab_size(), None
    else:
        vocabulary = sorted(set(text))
        index = {c: i for i, c in enumerate(vocabulary)}
        ids, vocab = [index[c] for c in text], len(vocabulary)
    tokens = torch.tensor(ids, device=device)
    split = int(len(tokens) * (1 - spec["dataset"]["val_fraction"]))
    return tokens[:split], tokens[split:], vocab, vocabulary


def minimum(curve: dict[int, float]) -> dict:
    step = min(curve, key=curve.get)
    return {"best_step": step, "best": curve[step], "last": curve[max(curve)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="char,gpt2", help="recipes, in order: char, gpt2")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337])
    parser.add_argument("--sides", nargs="+", choices=["trainyard", "peer"], default=["trainyard", "peer"])
    parser.add_argument("--steps", type=int, default=None, help="shorter runs (a smoke test; the recipes' own step counts otherwise)")
    parser.add_argument("--model", nargs="*", default=[], metavar="FIELD=VALUE", help="override the recipes' model fields (a smoke test)")
    parser.add_argument("--bpe-vocab", type=int, default=8192)
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no run after this many seconds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_fields = dict((k, parse_value(v)) for k, v in (item.split("=", 1) for item in args.model))
    started = time.perf_counter()

    def report(line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(text + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        data_root = scratch / "data"
        data_root.mkdir()
        corpus = REPO / "data" / "tinyshakespeare.txt"
        shutil.copy(corpus, data_root / corpus.name)
        text = corpus.read_text(encoding="utf-8")
        build_bpe(text[: int(len(text) * 0.9)], data_root / BPE_FILE, args.bpe_vocab)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
        }
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as the job's tf32 default
        for name in args.only.split(","):
            runs: dict[str, list[dict]] = {side: [] for side in args.sides}
            for seed in args.seeds:
                for side in args.sides:
                    if time.perf_counter() - started > args.budget_s:
                        report({"recipe": name, "side": side, "seed": seed, "skipped": "over --budget-s"})
                        continue
                    spec = job_spec(name, seed, args.steps, device, model_fields)
                    train, val, vocab, vocabulary = corpus_tokens(spec, data_root, device)
                    block = spec["model"]["block_size"]
                    began = time.perf_counter()
                    if side == "trainyard":
                        job = run_job(spec, scratch, data_root, env)
                        model, tokenizer, _ = load_model_from_checkpoint(job["checkpoint"])
                        assert vocabulary is None or tokenizer.chars == vocabulary, "the job's vocabulary is not the evaluator's"
                        model = model.to(device).eval()
                        curve, final = job["curve"], full_split_loss(lambda x: model(x)[0], val, block, batch=16)
                    else:
                        curve = {}
                        recipe = {**spec, "training": {**spec["training"]}}
                        peer = peer_model(recipe, train, vocab, seed, on_eval=lambda step, m: curve.__setitem__(step, round(full_split_loss(m, val, block, batch=16), 4)))
                        final = full_split_loss(peer, val, block, batch=16)
                        del peer
                    line = {"recipe": name, "side": side, "seed": seed, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                            "final_full_split": round(final, 4), **minimum(curve), "curve": curve, "seconds": round(time.perf_counter() - began, 1)}
                    runs[side].append(line)
                    report(line)
                    if device == "cuda":
                        torch.cuda.empty_cache()
            summary = {"recipe": name, "summary": True, "train_tokens": len(train), "val_tokens": len(val), "vocab": vocab}
            for side, lines in runs.items():
                if lines:
                    summary[side] = {key: [line[key] for line in lines] for key in ("best", "best_step", "last", "final_full_split")}
            if name == "char":
                summary["nanogpt_published_best"] = NANOGPT_CHAR_BEST_VAL
            report(summary)


if __name__ == "__main__":
    main()
