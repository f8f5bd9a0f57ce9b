"""A script that reports nothing: no `accelerator.log`, only `save_state(f"checkpoints/step_{N}")`
every `--save_every` steps, resuming from `--resume_from_checkpoint` by the step in that folder's
name. A small regression that takes `--step_seconds` a step. Written for Trainyard's tests; it
knows nothing of Trainyard."""

import argparse
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--save_every", type=int, default=10)
    parser.add_argument("--step_seconds", type=float, default=0.0)
    parser.add_argument("--resume_from_checkpoint", default=None)
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    target = torch.randn(8, 1)

    step = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        step = int(os.path.basename(args.resume_from_checkpoint).replace("step_", ""))
        accelerator.print(f"resumed at step {step}")
    while step < args.max_steps:
        inputs = torch.randn(16, 8)
        loss = torch.nn.functional.mse_loss(model(inputs), inputs @ target)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        time.sleep(args.step_seconds)
        if step % args.save_every == 0:
            accelerator.save_state(f"checkpoints/step_{step}")
    accelerator.print(f"done at step {step}, loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
