"""A text classifier in the shape of Accelerate's `examples/nlp_example.py`, with no downloads:
a small model built from a local config, on a labelled JSON-lines file (or generated sentences).

    accelerate launch examples/nlp_example.py --data reviews.jsonl --num_epochs 3
    trainyard submit --script examples/nlp_example.py -- --num_epochs 3

Each line of `--data` is {"text": "...", "label": 0 or 1}. Metrics go through `accelerator.log`
(train_loss per step, eval_loss and eval_accuracy per epoch, gathered over every process);
`save_state` after every epoch; `--resume_from_checkpoint DIR` continues from one.
"""

import argparse
import json
import os
import random
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

MODEL_CONFIG = {"vocab_size": 256, "embed_dim": 32, "hidden": 64, "num_labels": 2, "max_length": 64}
GOOD, BAD = ["great", "lovely", "superb", "fine", "happy"], ["awful", "dull", "poor", "sad", "broken"]


def generated_examples(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        label = rng.randrange(2)
        words = [rng.choice(GOOD if label else BAD) for _ in range(3)] + [rng.choice(["the", "a", "film", "it", "was"]) for _ in range(3)]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


class BytesClassifier(nn.Module):
    """Mean of byte embeddings, then an MLP: the stand-in for AutoModelForSequenceClassification."""

    def __init__(self, vocab_size, embed_dim, hidden, num_labels, max_length):
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab_size, embed_dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(embed_dim, hidden), nn.ReLU(), nn.Linear(hidden, num_labels))

    def forward(self, input_ids, offsets):
        return self.mlp(self.embed(input_ids, offsets))


def collate(rows, max_length):
    encoded = [torch.tensor(list(row["text"].encode()[:max_length]) or [0]) for row in rows]
    offsets = torch.tensor([0] + [len(e) for e in encoded[:-1]]).cumsum(0)
    return torch.cat(encoded), offsets, torch.tensor([int(row["label"]) for row in rows])


def get_dataloaders(args):
    rows = [json.loads(line) for line in open(args.data)] if args.data else generated_examples(400, args.seed)
    split = int(len(rows) * 0.8)
    make = lambda part, shuffle: DataLoader(  # noqa: E731
        part, batch_size=args.batch_size, shuffle=shuffle, drop_last=shuffle, collate_fn=lambda b: collate(b, MODEL_CONFIG["max_length"])
    )
    return make(rows[:split], True), make(rows[split:], False)


def checkpoint_epoch(path: str) -> int:
    """Epochs done in a checkpoint: the number its folder name ends with (epoch_2, step-00000002)."""
    return int(re.search(r"(\d+)$", os.path.basename(os.path.normpath(path))).group(1))


def training_function(args):
    accelerator = Accelerator()
    set_seed(args.seed)
    train_loader, eval_loader = get_dataloaders(args)
    model = BytesClassifier(**MODEL_CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    first_epoch = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        first_epoch = checkpoint_epoch(args.resume_from_checkpoint)  # checkpoints are taken at epoch ends
    step = first_epoch * (len(train_loader) // accelerator.gradient_accumulation_steps)

    for epoch in range(first_epoch, args.num_epochs):
        model.train()
        train_loader.set_epoch(epoch)
        for input_ids, offsets, labels in train_loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(input_ids, offsets), labels)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                accelerator.log({"train_loss": loss.item()}, step=step)

        model.eval()
        losses, correct, seen = [], 0, 0
        for input_ids, offsets, labels in eval_loader:
            with torch.no_grad():
                logits = model(input_ids, offsets)
            logits, labels = accelerator.gather_for_metrics((logits, labels))
            losses.append(F.cross_entropy(logits, labels, reduction="sum").item())
            correct += (logits.argmax(-1) == labels).sum().item()
            seen += len(labels)
        accelerator.log({"eval_loss": sum(losses) / seen, "eval_accuracy": correct / seen}, step=step)
        accelerator.print(f"epoch {epoch}: eval_accuracy {correct / seen:.3f}")
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch + 1}"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help='JSON lines of {"text", "label"}; generated sentences if left out')
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", default="checkpoints")
    parser.add_argument("--resume_from_checkpoint", default=None)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
