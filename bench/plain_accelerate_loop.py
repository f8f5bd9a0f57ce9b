"""The peer: the same model and data trained by a plain Accelerate loop, nothing else.

    accelerate launch bench/plain_accelerate_loop.py --spec spec.json --data data/tinyshakespeare.txt

Prints one JSON line with tokens/s measured between optimizer step `--skip` and the last step, and
each step's wall time (between optimizer steps, as the Trainyard loop's `step_time_s`). With
`--checkpoint-every N --checkpoint-dir DIR` it saves `accelerator.save_state(DIR/step-N)` every N
steps, synchronously: the peer of bench/checkpoint_stall.py. With `--gpu-defaults` it uses the
settings Trainyard defaults to on a GPU (torch.compile, fused AdamW, TF32), so that bench/gpu_suite.py
compares the same settings. A spec naming `dataset.tokenizer_file` is tokenized with that file (read
next to `--data`) instead of by characters.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from api_schemas import JobSpec
from workers.training.model import GPT

parser = argparse.ArgumentParser()
parser.add_argument("--spec", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--skip", type=int, default=20, help="steps excluded from the measurement (warm-up)")
parser.add_argument("--checkpoint-every", type=int, help="save_state every this many steps")
parser.add_argument("--checkpoint-dir", help="where save_state writes step-N/")
parser.add_argument("--gpu-defaults", action="store_true", help="torch.compile, fused AdamW and TF32, as Trainyard's cuda jobs")
args = parser.parse_args()
spec = JobSpec.model_validate_json(open(args.spec).read())
cfg = spec.training

accelerator = Accelerator(
    gradient_accumulation_steps=cfg.gradient_accumulation_steps, mixed_precision=cfg.precision, cpu=spec.resources.device == "cpu"
)
torch.manual_seed(cfg.seed)
text = open(args.data, encoding="utf-8").read()
if spec.dataset.tokenizer_file:  # a Hugging Face tokenizer.json beside the corpus (bench/gpu_suite.py's GPT-2-sized vocabulary)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.data).parent / spec.dataset.tokenizer_file))
    encoded = tokenizer.encode(text, add_special_tokens=False).ids
    vocab_size = tokenizer.get_vocab_size()
    tokens = torch.tensor(encoded[: int(len(encoded) * (1 - spec.dataset.val_fraction))])
else:
    chars = sorted(set(text))
    ids = {c: i for i, c in enumerate(chars)}
    vocab_size = len(chars)
    tokens = torch.tensor([ids[c] for c in text[: int(len(text) * (1 - spec.dataset.val_fraction))]])
block = spec.model.block_size
windows = tokens[: (len(tokens) - 1) // block * block + 1]
inputs = windows[:-1].view(-1, block)
targets = windows[1:].view(-1, block)
loader = DataLoader(TensorDataset(inputs, targets), batch_size=cfg.micro_batch_size, shuffle=True, drop_last=True)

model = GPT(spec.model, vocab_size)
if args.gpu_defaults:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
optimizer = torch.optim.AdamW(
    model.parameters(), lr=spec.optimizer.lr, betas=spec.optimizer.betas, weight_decay=spec.optimizer.weight_decay, fused=args.gpu_defaults
)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.max_steps)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
forward = torch.compile(model) if args.gpu_defaults else model

def synchronize() -> None:
    """GPU work is asynchronous: wait for it at the two ends of the measured interval only."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


step, started = 0, None
step_times, last_step_end = {}, time.perf_counter()
while step < cfg.max_steps:
    for x, y in loader:
        with accelerator.accumulate(model):
            _, loss = forward(x, y)
            accelerator.backward(loss)
            if accelerator.sync_gradients and cfg.grad_clip_norm:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if accelerator.sync_gradients:
            step += 1
            now = time.perf_counter()
            step_times[step], last_step_end = now - last_step_end, now
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                accelerator.save_state(f"{args.checkpoint_dir}/step-{step:08d}")  # paid for by the next step, as in Trainyard's loop
            if step == args.skip:
                synchronize()
                started = time.perf_counter()
            if step >= cfg.max_steps:
                break
synchronize()
elapsed = time.perf_counter() - started
tokens_per_step = cfg.micro_batch_size * cfg.gradient_accumulation_steps * block * accelerator.num_processes
peak_memory_mb = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
if accelerator.is_main_process:
    print(json.dumps({
        "tokens_per_s": (cfg.max_steps - args.skip) * tokens_per_step / elapsed, "step_times": step_times, "peak_memory_mb": peak_memory_mb,
    }))
