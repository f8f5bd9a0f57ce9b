"""`make demo`: train a character-level GPT on Shakespeare end to end, through the public API.

Starts the embedded stack (API, scheduler, one local worker) in a fresh data dir, submits
examples/shakespeare-char.json, follows it with the progress bar, downloads the newest
checkpoint's weights with a sha256 check, loads them into a fresh model, and prints a sample
and the weights' validation loss next to the job's own last eval_loss. Exits non-zero, with the
reason, on any failure; the stack is stopped either way.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from api_schemas import JobSpec
from stack.embedded import embedded_stack
from trainyard.client import Client, TrainyardError
from trainyard.client_cli import download_with_progress, human_bytes, load_spec_file, print_table, report_outcome
from trainyard.progress import follow_job
from workers.supervisor import free_port

REPO = Path(__file__).resolve().parent.parent
SAMPLE_CHARS = 200
SAMPLE_SEED = 1337


class DemoError(Exception):
    pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stack.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=REPO / "examples" / "shakespeare-char.json", help="job spec (JSON or YAML)")
    parser.add_argument("--max-steps", type=int, help="train for this many steps instead (for a quick run)")
    parser.add_argument("--data-dir", type=Path, default=Path(".trainyard-demo"), help="wiped first (default .trainyard-demo)")
    parser.add_argument("--port", type=int, default=0, help="API port (default: a free one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_demo(args)
    # RuntimeError: what embedded_stack raises when the stack does not come up.
    except (DemoError, TrainyardError, OSError, RuntimeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def run_demo(args: argparse.Namespace) -> int:
    spec = demo_spec(args.spec, args.max_steps)
    wipe_data_dir(args.data_dir)
    port = args.port or free_port()
    print(f"starting Trainyard (API, scheduler, 1 worker) in {args.data_dir} …")
    with embedded_stack(args.data_dir, port, workers=1) as stack, Client(stack.url, stack.token) as client:
        print(f"API up at {stack.url}; watch it live at {stack.url}/dashboard (token: {stack.data_dir / 'token'})")
        job = client.submit(spec)
        print(f"submitted job {job.id} ({job.name}): {job.max_steps} steps of {job.effective_batch_size} × {job.spec.model.block_size} tokens")
        job = follow_job(client, job.id)
        if report_outcome(job) != 0:
            raise DemoError(f"job {job.id} did not succeed; the stack's own logs are in {args.data_dir / 'logs'}")

        checkpoints = client.checkpoints(job.id)
        if not checkpoints:
            raise DemoError(f"job {job.id} succeeded but lists no checkpoints")
        print_table(["CHECKPOINT", "STEP", "SIZE", "SHA256"], [[c.id, c.step, human_bytes(c.size_bytes), c.sha256[:16]] for c in checkpoints])
        latest = max(checkpoints, key=lambda c: c.step)
        dest = args.data_dir / "downloads" / f"job{job.id}-step{latest.step}.safetensors"
        download_with_progress(client, latest.id, dest)
        print(f"downloaded checkpoint {latest.id} (step {latest.step}) to {dest}, sha256 verified")

        eval_series = client.metrics(job.id, names=["eval_loss"]).series.get("eval_loss")
        reported = (eval_series.steps[-1], eval_series.values[-1]) if eval_series and eval_series.values else None

    # The stack is down: the CPU is ours for loading the weights and evaluating them.
    check_weights(dest, job.spec, reported)
    return 0


def demo_spec(path: Path, max_steps: int | None) -> dict:
    """The spec to submit, with `--max-steps` applied (and a warmup that still fits inside it)."""
    spec = load_spec_file(path)
    if max_steps is not None:
        spec.setdefault("training", {})["max_steps"] = max_steps
        schedule = spec.setdefault("schedule", {})
        if (schedule.get("warmup_steps") or 0) >= max_steps:
            schedule["warmup_steps"] = max_steps // 10
    return spec


def wipe_data_dir(data_dir: Path) -> None:
    """Start from nothing, but only delete a directory that is empty or was a Trainyard data dir."""
    if not data_dir.exists():
        return
    if any(data_dir.iterdir()) and not ((data_dir / "token").exists() or (data_dir / "trainyard.db").exists()):
        raise DemoError(f"{data_dir} is not a Trainyard data dir; refusing to delete it (pick another --data-dir)")
    shutil.rmtree(data_dir)



# -- the downloaded weights ----------------------------------------------------------------------

def check_weights(model_file: Path, spec: JobSpec, reported_eval: tuple[int, float] | None) -> None:
    """Load the weights into a fresh model; print their validation loss and a sample."""
    import torch

    from workers.training import eval_dataloader, evaluate, load_model, load_text_corpus

    corpus = load_text_corpus(spec.dataset, REPO / "data")  # the tokenizer and validation split the job used
    model = load_model(spec, corpus.tokenizer.vocab_size, model_file)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"loaded the weights into a fresh GPT ({parameters / 1e6:.2f}M parameters)")

    # The whole validation split, as the job's last evaluation read it, so the two numbers are comparable.
    loss = evaluate(model, eval_dataloader(corpus.val, spec, whole=True))
    reported = f"the job reported {reported_eval[1]:.4f} at step {reported_eval[0]}" if reported_eval else "the job reported none"
    print(f"eval loss of the downloaded weights: {loss:.4f} ({reported})")

    torch.manual_seed(SAMPLE_SEED)  # generate() samples with torch's global generator
    prompt = torch.tensor([corpus.tokenizer.encode("\n")], dtype=torch.long)
    tokens = model.generate(prompt, SAMPLE_CHARS, temperature=0.8)
    print(f"\nsample ({SAMPLE_CHARS} characters, seed {SAMPLE_SEED}):\n{'-' * 60}")
    print(corpus.tokenizer.decode(tokens[0, prompt.shape[1] :].tolist()))
    print("-" * 60)


if __name__ == "__main__":
    sys.exit(main())
