"""A causal-LM script in the shape of transformers' `run_clm_no_trainer.py`, tiny and offline:
`save_state(f"step_{N}")` every `--checkpointing_steps` (or `epoch_{N}` with "epoch"),
`accelerator.log` once an epoch with a tensor `eval_loss`, resume by parsing the step or epoch out of
`--resume_from_checkpoint`'s folder name with `skip_first_batches`, and the final model written
with `save_pretrained` into `--output_dir`. Written for Trainyard's tests; it knows nothing of Trainyard."""

import argparse
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel


def corpus(samples: int, block_size: int, seed: int) -> torch.Tensor:
    """Byte sequences with a pattern a tiny model picks up: counting up from a random start."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 200, (samples, 1), generator=generator)
    return (starts + torch.arange(block_size)) % 256


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--train_samples", type=int, default=400)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--checkpointing_steps", default=None, help="a number of steps, or 'epoch'")
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    accelerator = Accelerator(project_dir=args.output_dir)
    set_seed(args.seed)
    train = corpus(args.train_samples, args.block_size, args.seed)
    evaluation = corpus(32, args.block_size, args.seed + 1)
    config = GPT2Config(vocab_size=256, n_positions=args.block_size, n_embd=32, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_dataloader = DataLoader(train, batch_size=args.per_device_train_batch_size, shuffle=True)
    eval_dataloader = DataLoader(evaluation, batch_size=8)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / accelerator.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    accelerator.init_trackers("clm_no_trainer", vars(args))

    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        # As run_clm_no_trainer.py does: the folder's own name says where training was.
        training_difference = os.path.splitext(os.path.basename(args.resume_from_checkpoint))[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            completed_steps = starting_epoch * num_update_steps_per_epoch
        else:
            resume_step = int(training_difference.replace("step_", "")) * accelerator.gradient_accumulation_steps
            starting_epoch = resume_step // len(train_dataloader)
            completed_steps = resume_step // accelerator.gradient_accumulation_steps
            resume_step -= starting_epoch * len(train_dataloader)

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = 0
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
            if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                output_dir = f"step_{completed_steps}"
                if args.output_dir is not None:
                    output_dir = os.path.join(args.output_dir, output_dir)
                accelerator.save_state(output_dir)
            if completed_steps >= max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                losses.append(accelerator.gather_for_metrics(model(input_ids=batch, labels=batch).loss.repeat(len(batch))))
        eval_loss = torch.mean(torch.cat(losses))
        accelerator.print(f"epoch {epoch}: eval_loss: {eval_loss}")
        accelerator.log(
            {"eval_loss": eval_loss, "perplexity": math.exp(eval_loss), "train_loss": total_loss.item() / len(train_dataloader),
             "epoch": epoch, "step": completed_steps},
            step=completed_steps,
        )
        if checkpointing_steps == "epoch":
            output_dir = f"epoch_{epoch}"
            if args.output_dir is not None:
                output_dir = os.path.join(args.output_dir, output_dir)
            accelerator.save_state(output_dir)

    accelerator.end_training()
    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)


if __name__ == "__main__":
    main()
