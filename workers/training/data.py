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

from api_schemas import DatasetConfig, DiskDatasetConfig, HFModelConfig, LabelledDatasetConfig, MLPConfig
from api_schemas.labelled_data import LabelledDataError, read_disk_dataset, read_labelled


class SpecError(ValueError):
    """The spec asks for something its data cannot give: a missing corpus, more windows than it holds."""


class Tokenizer:
    """`char`: one id per distinct character of the corpus; `byte`: one id per byte value; `file`: a
    Hugging Face `tokenizers` tokenizer.json (its whole definition is kept, so a checkpoint carries it)."""

    def __init__(self, kind: str, chars: list[str] | None = None, definition: str | None = None):
        self.kind, self.chars, self.definition = kind, chars, definition
        self._ids = {c: i for i, c in enumerate(chars)} if chars is not None else None
        self._file = _tokenizers().Tokenizer.from_str(definition) if kind == "file" else None

    @classmethod
    def build(cls, kind: str, text: str) -> Tokenizer:
        return cls("char", sorted(set(text))) if kind == "char" else cls("byte")

    @classmethod
    def for_dataset(cls, config: DatasetConfig | LabelledDatasetConfig | DiskDatasetConfig, data_root: Path, text: str) -> Tokenizer:
        """The dataset's tokenizer: its `tokenizer_file` if it names one, else char or byte over `text`."""
        if config.tokenizer_file is None:
            return cls.build(config.tokenizer, text)
        root = data_root.resolve()
        path = (root / config.tokenizer_file).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise SpecError(f"dataset.tokenizer_file: no file {config.tokenizer_file!r} under the data root")
        try:
            return cls("file", definition=path.read_text(encoding="utf-8"))
        except Exception as exc:  # the tokenizers library raises its own exception type for a bad file
            raise SpecError(f"dataset.tokenizer_file: not a tokenizer.json: {exc}") from None

    @classmethod
    def from_json(cls, data: dict) -> Tokenizer:
        return cls(data["kind"], data.get("chars"), data.get("definition"))

    def to_json(self) -> dict:
        return {"kind": self.kind, "chars": self.chars} if self.kind != "file" else {"kind": "file", "definition": self.definition}

    @property
    def vocab_size(self) -> int:
        if self.kind == "file":
            return self._file.get_vocab_size()
        return len(self.chars) if self.kind == "char" else 256

    def encode(self, text: str) -> list[int]:
        if self.kind == "file":
            return self._file.encode(text, add_special_tokens=False).ids
        return [self._ids[c] for c in text] if self.kind == "char" else list(text.encode("utf-8", "surrogateescape"))

    def decode(self, ids: list[int]) -> str:
        if self.kind == "file":
            return self._file.decode(ids)
        return "".join(self.chars[i] for i in ids) if self.kind == "char" else bytes(ids).decode("utf-8", "replace")


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise SpecError("dataset.tokenizer_file: needs the tokenizers package: pip install 'trainyard[hf]'") from None
    return tokenizers


class EpochSelection(Dataset):
    """`total` samples, in order without a seed. With a seed, each epoch is a shuffled selection of
    `multiple_of × k` of them, so that an epoch is a whole number of optimizer steps (see the loop)."""

    def __init__(self, total: int, seed: int | None, multiple_of: int, too_few: str):
        self.total, self.seed = total, seed
        self.count = total // multiple_of * multiple_of
        if self.count < 1:
            raise SpecError(f"{too_few}, too few to fill {multiple_of}")
        self.order = torch.arange(self.count)

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for `epoch` (a no-op for an evaluation set, which has no seed)."""
        if self.seed is not None:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self.order = torch.randperm(self.total, generator=generator)[: self.count]

    def __len__(self) -> int:
        return self.count


class TokenWindows(EpochSelection):
    """Windows of block_size + 1 tokens, returned as (input, target shifted by one). An epoch holds as
    many windows as the corpus has non-overlapping ones. Aligned, they are those windows, shuffled;
    with `random_offsets` (and a seed) each starts at an offset drawn from (seed, epoch), as nanoGPT
    samples, so a second epoch is not a replay of the first."""

    def __init__(
        self, tokens: torch.Tensor, block_size: int, seed: int | None = None, multiple_of: int = 1, random_offsets: bool = False
    ):
        self.tokens, self.block_size, self.random_offsets = tokens, block_size, random_offsets
        total = (len(tokens) - 1) // block_size
        too_few = f"model.block_size, training.micro_batch_size: {len(tokens)} tokens make {total} windows of {block_size}"
        super().__init__(total, seed, multiple_of, too_few)
        self.starts = self.order * block_size

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self.seed is not None and self.random_offsets:
            # Any offset that leaves room for a whole window: 0 .. len - block_size - 1. Drawn for
            # every window and then trimmed, as the shuffle is, so the draws don't depend on the trim.
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self.starts = torch.randint(len(self.tokens) - self.block_size, (self.total,), generator=generator)[: self.count]
        else:
            self.starts = self.order * self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[index])
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class LabelledTexts(EpochSelection):
    """Texts as fixed-length token ids (padded with `pad_id`) and their label ids: (ids, label)."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, seed: int | None = None, multiple_of: int = 1):
        self.ids, self.labels = ids, labels
        super().__init__(len(ids), seed, multiple_of, f"training.micro_batch_size: {len(ids)} examples")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = int(self.order[index])
        return self.ids[row], self.labels[row]


@dataclass
class TextCorpus:
    train: torch.Tensor
    val: torch.Tensor
    tokenizer: Tokenizer


def dataset_file(config: DatasetConfig | LabelledDatasetConfig | DiskDatasetConfig, data_root: Path) -> Path:
    """The dataset's file (its directory for `hf_disk`) under the data root."""
    root = data_root.resolve()
    path = (root / config.relative_path).resolve()
    if not path.is_relative_to(root):
        raise SpecError(f"dataset.path: {config.relative_path!r} resolves outside the data root")
    if config.kind == "hf_disk" and not path.is_dir():
        raise SpecError(f"dataset.path: {config.relative_path!r} is not a directory under the data root")
    if config.kind != "hf_disk" and not path.is_file():
        raise SpecError(f"dataset.path: {config.relative_path!r} is not a file under the data root")
    return path


def read_texts(
    config: LabelledDatasetConfig | DiskDatasetConfig, data_root: Path, labelled: bool = True
) -> tuple[list[str], list[str] | None]:
    """(texts, labels) of a JSON-lines, CSV or `datasets` directory; no labels read when not `labelled`."""
    path = dataset_file(config, data_root)
    try:
        if config.kind == "hf_disk":
            return read_disk_dataset(path, config.split, config.text_column, config.label_column if labelled else None)
        return read_labelled(path, config.kind, config.text_column, config.label_column)
    except LabelledDataError as exc:
        raise SpecError(f"dataset.path: {exc}") from None


def load_text_corpus(config: DatasetConfig | DiskDatasetConfig, data_root: Path) -> TextCorpus:
    """Read and tokenise the corpus (a `datasets` directory's texts joined by newlines); the last
    `val_fraction` of it is held out for evaluation."""
    if config.kind == "hf_disk":
        text = "\n".join(read_texts(config, data_root, labelled=False)[0])
    else:
        text = _read_text(dataset_file(config, data_root), config)
    tokenizer = Tokenizer.for_dataset(config, data_root, text)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    split = int(len(tokens) * (1 - config.val_fraction))
    return TextCorpus(train=tokens[:split], val=tokens[split:], tokenizer=tokenizer)


def _read_text(path: Path, config: DatasetConfig) -> str:
    """The corpus as text. The byte tokenizer takes any bytes (those that are no UTF-8 kept as they
    are: surrogateescape); the others read characters, so a file that is not UTF-8 is the spec's
    mistake, said once rather than a traceback on each of the job's restarts."""
    data = path.read_bytes()
    if config.tokenizer == "byte" and config.tokenizer_file is None:
        return data.decode("utf-8", "surrogateescape")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        reader = "the tokenizer_file" if config.tokenizer_file else f"the {config.tokenizer} tokenizer"
        raise SpecError(
            f"dataset.path: {path.name} is not UTF-8 text (byte {exc.start:,} is not), which {reader} reads: "
            "save it as UTF-8, or use `tokenizer: byte`"
        ) from None


@dataclass
class LabelledCorpus:
    train: LabelledTexts
    val: LabelledTexts
    tokenizer: Tokenizer
    labels: list[str]  # label id i is labels[i]


def load_labelled_corpus(
    config: LabelledDatasetConfig | DiskDatasetConfig, model: MLPConfig | HFModelConfig, data_root: Path
) -> LabelledCorpus:
    """Labelled texts, each cut or padded to `model.max_length` ids; the last `val_fraction` of the
    rows is held out for evaluation. Label ids follow the labels' sorted order."""
    texts, labels = read_texts(config, data_root)
    names = sorted(set(labels))
    if len(names) != model.num_labels:
        raise SpecError(f"model.num_labels is {model.num_labels} but the dataset holds {len(names)} distinct labels")
    tokenizer = Tokenizer.for_dataset(config, data_root, "".join(texts))
    pad_id = tokenizer.vocab_size  # one past the vocabulary: the classifier ignores it
    ids = torch.full((len(texts), model.max_length), pad_id, dtype=torch.long)
    for row, text in enumerate(texts):
        encoded = tokenizer.encode(text)[: model.max_length]
        ids[row, : len(encoded)] = torch.tensor(encoded, dtype=torch.long)
    label_ids = torch.tensor([names.index(label) for label in labels], dtype=torch.long)
    split = int(len(texts) * (1 - config.val_fraction))
    if split < 1 or split == len(texts):
        raise SpecError(f"dataset.val_fraction: {len(texts)} examples leave none for training or for evaluation")
    return LabelledCorpus(
        train=LabelledTexts(ids[:split], label_ids[:split]), val=LabelledTexts(ids[split:], label_ids[split:]),
        tokenizer=tokenizer, labels=names,
    )
