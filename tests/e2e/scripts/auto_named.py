"""A script in the shape of projects that let Accelerate name their checkpoints:
`ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=...)`, a bare `save_state()`
every `--save_every` steps (Accelerate writes `<project_dir>/checkpoints/checkpoint_<i>` and
deletes the oldest past the limit), and a resume from `--resume_from_checkpoint PATH` that
restores the iteration as Accelerate's own error message advises (`checkpoint_<i>` was saved
after step (i + 1) * save_every). A small regression on random batches: the RNG state that
`load_state` restores makes a resumed run end where an uninterrupted one does. Written for
Trainyard's tests; it knows nothing of Trainyard."""

import argparse
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--save_every", type=int, default=10)
    parser.add_argument("--step_seconds", type=float, default=0.0)
    parser.add_argument("--resume_from_checkpoint", default=None)
    args = parser.parse_args()

    config = ProjectConfiguration(project_dir="run", automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=config)
    set_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    target = torch.ones(8, 1)

    step = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        iteration = int(os.path.basename(args.resume_from_checkpoint).rsplit("_", 1)[-1])
        accelerator.project_configuration.iteration = iteration + 1
        step = (iteration + 1) * args.save_every
        accelerator.print(f"resumed from {os.path.basename(args.resume_from_checkpoint)} at step {step}")
    while step < args.max_steps:
        inputs = torch.randn(16, 8, device=accelerator.device)
        loss = torch.nn.functional.mse_loss(model(inputs), inputs @ target.to(accelerator.device))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        time.sleep(args.step_seconds)
        if step % args.save_every == 0:
            accelerator.save_state()
    weight = accelerator.unwrap_model(model).weight
    accelerator.print(f"done at step {step}, weight sum {weight.sum().item():.8f}")


if __name__ == "__main__":
    main()
