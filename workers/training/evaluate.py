"""Validation loss: the same function inside training and on downloaded weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, Subset

from api_schemas import JobSpec
from workers.training.data import TokenWindows


def eval_dataloader(val_tokens: torch.Tensor, spec: JobSpec) -> DataLoader:
    """The first `eval_batches` batches of every process's micro-batch size, in order.

    The count comes from the spec, not from the processes running: the same windows whether one
    process with micro-batch 12 or two with 6 evaluate, and anyone can recompute the loss from a
    downloaded checkpoint on one process."""
    windows = TokenWindows(val_tokens, spec.model.block_size)
    count = min(len(windows), spec.training.eval_batches * spec.training.micro_batch_size * spec.world_size)
    return DataLoader(Subset(windows, range(count)), batch_size=spec.training.micro_batch_size, shuffle=False)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator | None = None) -> float:
    """Mean per-token cross-entropy over every sample of `loader`, across all processes."""
    was_training = model.training
    model.eval()
    losses = []
    for inputs, targets in loader:
        logits, _ = model(inputs)
        per_sample = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)
        # gather_for_metrics drops the samples Accelerate repeated to even out the last batch.
        losses.append(accelerator.gather_for_metrics(per_sample) if accelerator else per_sample)
    model.train(was_training)
    return torch.cat(losses).float().mean().item()
