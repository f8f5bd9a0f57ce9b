"""A `custom` loop fed by a loader, as users write them (the GAN example makes its own samples): a
bag-of-characters classifier on the job's labelled rows, read in file order. After a loss-guard
rollback it passes over the batches of `ctx.skip_steps` steps with accelerate's skip_first_batches,
and keeps how many it passed over in its checkpoints, so later resumes land where the data stands.
With `config.linger_s` it stays that long after its last checkpoint, as a loop that uploads its
samples or waits on its tracker's finish() does."""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

CHARACTERS = 128  # a text's features: how often each ASCII character occurs in it


class LabelledRows(Dataset):
    def __init__(self, texts: list[str], labels: list[str]):
        self.names = sorted(set(labels))
        self.texts, self.labels = texts, [self.names.index(label) for label in labels]

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        codes = torch.tensor([min(ord(c), CHARACTERS - 1) for c in self.texts[index]], dtype=torch.long)
        return torch.bincount(codes, minlength=CHARACTERS).float(), self.labels[index]


def train(ctx) -> None:
    spec, accelerator = ctx.spec, ctx.accelerator
    rows = LabelledRows(*ctx.dataset)
    model = nn.Sequential(nn.Linear(CHARACTERS, 32), nn.ReLU(), nn.Linear(32, len(rows.names)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.optimizer.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = ctx.dataloader(rows, shuffle=False)  # one pass over the rows, in the file's order
    ctx.register_model("classifier", model)

    resumed = ctx.load_checkpoint()
    step = resumed["step"] if resumed else 0
    # Where the data stands: a batch per step trained, and those of the steps a rollback passed over.
    skipped = (resumed or {}).get("skipped_steps", 0) + ctx.skip_steps
    for features, labels in accelerator.skip_first_batches(loader, step + skipped):
        if step >= spec.training.max_steps:
            break
        loss = F.cross_entropy(model(features), labels)
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        optimizer.step()

        step += 1
        ctx.log_metric(step, {"train_loss": accelerator.reduce(loss.detach(), reduction="mean").item()})
        stop = ctx.should_stop()
        if ctx.checkpoint_due(step) or stop:
            ctx.save_checkpoint(step, {"skipped_steps": skipped})
        if stop:
            return
    time.sleep(ctx.config.get("linger_s", 0))
