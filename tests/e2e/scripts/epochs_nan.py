"""A script in the shape of the epoch-based examples: `accelerator.log({"loss": …}, step=global_step)`
every step and `save_state(f"checkpoints/epoch_{E}")` at the end of each epoch, resuming from
`--resume_from_checkpoint` at the epoch its folder names. `--nan_at_step S` makes the loss NaN at
global step S unless resuming (a transient fault: a flaky device, a bad batch read once), and the
NaN goes into the weights as it would. Written for Trainyard's tests; it knows nothing of Trainyard."""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps_per_epoch", type=int, default=10)
    parser.add_argument("--nan_at_step", type=int, default=0)
    parser.add_argument("--resume_from_checkpoint", default=None)
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    target = torch.randn(8, 1)

    first_epoch = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        first_epoch = int(os.path.basename(args.resume_from_checkpoint).replace("epoch_", ""))
        accelerator.print(f"resumed after epoch {first_epoch}")
    for epoch in range(first_epoch + 1, args.epochs + 1):
        for batch in range(args.steps_per_epoch):
            step = (epoch - 1) * args.steps_per_epoch + batch + 1
            inputs = torch.randn(16, 8)
            loss = torch.nn.functional.mse_loss(model(inputs), inputs @ target)
            if step == args.nan_at_step and not args.resume_from_checkpoint:
                loss = loss * float("nan")
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"loss": loss.item()}, step=step)
        accelerator.save_state(f"checkpoints/epoch_{epoch}")
    accelerator.print(f"done after epoch {args.epochs}")


if __name__ == "__main__":
    main()
