"""A character-level GPT trained with Accelerate: a standalone script, nothing of Trainyard in it.

    accelerate launch examples/char_gpt.py --data tinyshakespeare.txt --max_steps 200
    trainyard submit --script examples/char_gpt.py -- --max_steps 200

It logs with `accelerator.log`, saves with `accelerator.save_state` every `--checkpoint_every`
steps, and resumes with `--resume_from_checkpoint DIR`: `load_state`, then `skip_first_batches`
past what the checkpoint's step already consumed, so no step is trained twice.
"""

import argparse
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

FALLBACK_TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.\n" * 40


class CharWindows(Dataset):
    """Non-overlapping windows of `block_size + 1` characters: inputs and the next character."""

    def __init__(self, ids: torch.Tensor, block_size: int):
        self.ids, self.block_size = ids, block_size

    def __len__(self):
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i):
        chunk = self.ids[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        causal = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_embd: int, n_head: int, n_layer: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        return self.head(self.blocks(x))


def checkpoint_step(path: str) -> int:
    """The step a checkpoint folder was saved at: the number its name ends with (step_12, step-00000012)."""
    return int(re.search(r"(\d+)$", os.path.basename(os.path.normpath(path))).group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="a text file; a built-in paragraph if left out")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--checkpoint_every", type=int, default=50)
    parser.add_argument("--output_dir", default="checkpoints")
    parser.add_argument("--resume_from_checkpoint", default=None, help="a folder written by save_state")
    args = parser.parse_args()

    accelerator = Accelerator()  # processes, precision and accumulation come from `accelerate launch`
    set_seed(args.seed)
    text = open(args.data, encoding="utf-8").read() if args.data else FALLBACK_TEXT
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    loader = DataLoader(CharWindows(ids, args.block_size), batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = CharGPT(len(vocab), args.block_size, args.n_embd, args.n_head, args.n_layer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.max_steps) / args.max_steps)))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        step = checkpoint_step(args.resume_from_checkpoint)
        accelerator.print(f"resumed from {args.resume_from_checkpoint} at step {step}")
    # Micro-batches already consumed: skip them in the epoch the checkpoint was taken in.
    consumed = step * accelerator.gradient_accumulation_steps
    epoch, skip = divmod(consumed, len(loader))

    model.train()
    while step < args.max_steps:
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for inputs, targets in batches:
            with accelerator.accumulate(model):
                logits = model(inputs)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                accelerator.log({"train_loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)
                if step % args.checkpoint_every == 0 or step == args.max_steps:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
                if step >= args.max_steps:
                    break
        epoch += 1
    accelerator.end_training()


if __name__ == "__main__":
    main()
