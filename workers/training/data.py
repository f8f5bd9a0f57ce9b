"""Text corpora as fixed windows of tokens, in an order fixed by (seed, epoch).

The order lives in the dataset, not in a sampler: `set_epoch` picks the epoch's permutation, and
the dataloader reads indices in sequence. So the same batches come out whatever wraps the
dataloader (Accelerate's sharding across processes, `skip_first_batches` on resume), which is
what makes exact resume and process-count equivalence hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from api_schemas import DatasetConfig


class SpecError(ValueError):
    """The spec asks for something its data cannot give: a missing corpus, more windows than it holds."""


class Tokenizer:
    """`char`: one id per distinct character of the corpus; `byte`: one id per byte value."""

    def __init__(self, kind: str, chars: list[str] | None = None):
        self.kind, self.chars = kind, chars
        self._ids = {c: i for i, c in enumerate(chars)} if chars is not None else None

    @classmethod
    def build(cls, kind: str, text: str) -> Tokenizer:
        return cls("char", sorted(set(text))) if kind == "char" else cls("byte")

    @classmethod
    def from_json(cls, data: dict) -> Tokenizer:
        return cls(data["kind"], data.get("chars"))

    def to_json(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}

    @property
    def vocab_size(self) -> int:
        return len(self.chars) if self.kind == "char" else 256

    def encode(self, text: str) -> list[int]:
        return [self._ids[c] for c in text] if self.kind == "char" else list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids) if self.kind == "char" else bytes(ids).decode("utf-8", "replace")


class TokenWindows(Dataset):
    """Non-overlapping windows of block_size + 1 tokens, returned as (input, target shifted by one).

    With a seed, each epoch is a shuffled selection of `multiple_of × k` of them, so that an epoch
    is a whole number of optimizer steps (see the training loop)."""

    def __init__(self, tokens: torch.Tensor, block_size: int, seed: int | None = None, multiple_of: int = 1):
        self.tokens, self.block_size, self.seed = tokens, block_size, seed
        self.total = (len(tokens) - 1) // block_size
        self.count = self.total // multiple_of * multiple_of
        if self.count < 1:
            raise SpecError(
                f"model.block_size, training.micro_batch_size: {len(tokens)} tokens make {self.total} windows of "
                f"{block_size}, too few to fill {multiple_of}"
            )
        self.order = torch.arange(self.count)

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for `epoch` (a no-op for an evaluation set, which has no seed)."""
        if self.seed is not None:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self.order = torch.randperm(self.total, generator=generator)[: self.count]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.order[index]) * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


@dataclass
class TextCorpus:
    train: torch.Tensor
    val: torch.Tensor
    tokenizer: Tokenizer


def load_text_corpus(config: DatasetConfig, data_root: Path) -> TextCorpus:
    """Read and tokenise the corpus; the last `val_fraction` of it is held out for evaluation."""
    root = data_root.resolve()
    path = (root / config.path).resolve()
    if not path.is_relative_to(root):
        raise SpecError(f"dataset.path: {config.path!r} resolves outside the data root")
    if not path.is_file():
        raise SpecError(f"dataset.path: {config.path!r} is not a file under the data root")
    text = path.read_text(encoding="utf-8")
    tokenizer = Tokenizer.build(config.tokenizer, text)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    split = int(len(tokens) * (1 - config.val_fraction))
    return TextCorpus(train=tokens[:split], val=tokens[split:], tokenizer=tokenizer)
