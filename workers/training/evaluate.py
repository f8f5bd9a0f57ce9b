"""Validation metrics: the same functions inside training and on downloaded weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, Subset

from api_schemas import JobSpec
from workers.training.data import LabelledTexts, TokenWindows


def eval_dataloader(val: torch.Tensor | LabelledTexts, spec: JobSpec, whole: bool = False) -> DataLoader:
    """Validation samples in batches of the micro-batch size: validation tokens cut into
    non-overlapping windows (gpt), or labelled texts (mlp). Every sample once when `whole`, when
    `eval_batches` is null or when it covers the split; else `eval_batches` batches per process,
    spread evenly over the whole split.

    Spread, not the first ones: the start of a split is no fair sample of it (the first windows
    of Tiny Shakespeare's read 0.01 to 0.05 below the whole split's loss). The sample depends only on
    the data and the spec's counts, not on the seed or the processes running: runs compare with each
    other, one process with micro-batch 12 evaluates what two with 6 do, and anyone can recompute the
    loss from a downloaded checkpoint on one process."""
    samples = val if isinstance(val, LabelledTexts) else TokenWindows(val, spec.model.block_size)
    total = count = len(samples)
    if not whole and spec.training.eval_batches is not None:
        count = min(total, spec.training.eval_batches * spec.training.micro_batch_size * spec.world_size)
    return DataLoader(Subset(samples, [i * total // count for i in range(count)]), batch_size=spec.training.micro_batch_size, shuffle=False)


@torch.no_grad()
def evaluate_metrics(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator | None = None) -> dict[str, float]:
    """Mean cross-entropy per sample (per token for a language model) over every sample of
    `loader`, across all processes; and for a classifier the share of labels predicted right."""
    was_training = model.training
    model.eval()
    losses, correct = [], []
    gather = accelerator.gather_for_metrics if accelerator else (lambda tensor: tensor)
    for inputs, targets in loader:
        logits, _ = model(inputs)
        if logits.dim() == 3:  # (batch, positions, vocabulary): a language model
            per_sample = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)
        else:
            per_sample = F.cross_entropy(logits, targets, reduction="none")
            correct.append(gather((logits.argmax(dim=-1) == targets).float()))
        # gather_for_metrics drops the samples Accelerate repeated to even out the last batch.
        losses.append(gather(per_sample))
    model.train(was_training)
    metrics = {"eval_loss": torch.cat(losses).float().mean().item()}
    if correct:
        metrics["eval_accuracy"] = torch.cat(correct).mean().item()
    return metrics


def evaluate(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator | None = None) -> float:
    """The validation loss alone."""
    return evaluate_metrics(model, loader, accelerator)["eval_loss"]
