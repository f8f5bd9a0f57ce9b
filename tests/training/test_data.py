"""Tokenizers, the train/validation split and the sample order the loop depends on."""

from __future__ import annotations

import json

import pytest
import torch

from api_schemas import DatasetConfig
from tests.helpers import job_spec
from workers.training import SpecError, Tokenizer, TokenWindows, eval_dataloader, load_text_corpus

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n"


@pytest.mark.parametrize(("kind", "text", "vocab_size"), [("char", TEXT, len(set(TEXT))), ("byte", TEXT + "é ✓", 256)])
def test_a_tokenizer_round_trips_text_and_survives_its_json_form(kind, text, vocab_size):
    tokenizer = Tokenizer.build(kind, text)
    restored = Tokenizer.from_json(json.loads(json.dumps(tokenizer.to_json())))
    ids = restored.encode(text)
    assert restored.vocab_size == vocab_size and max(ids) < vocab_size
    assert ids == tokenizer.encode(text) and restored.decode(ids) == text


def test_validation_is_the_tail_of_the_corpus(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT * 10)
    corpus = load_text_corpus(DatasetConfig(kind="text", path="corpus.txt", val_fraction=0.25), tmp_path)
    assert torch.equal(torch.cat([corpus.train, corpus.val]), torch.tensor(corpus.tokenizer.encode(TEXT * 10)))
    assert len(corpus.val) == len(TEXT) * 10 - int(len(TEXT) * 10 * 0.75)
    with pytest.raises(SpecError, match="dataset.path"):
        load_text_corpus(DatasetConfig(kind="text", path="absent.txt"), tmp_path)


def test_a_corpus_that_is_not_utf8_is_the_specs_mistake_for_chars_and_bytes_as_they_are_for_bytes(tmp_path):
    # Found by a new user: a Latin-1 corpus failed each attempt with a UnicodeDecodeError traceback,
    # and was retried; the byte tokenizer, which takes any bytes, failed the same way.
    data = "café, naïve\n".encode("latin-1") * 20
    (tmp_path / "latin.txt").write_bytes(data)
    with pytest.raises(SpecError, match=r"latin.txt is not UTF-8 text \(byte 3 is not\), which the char tokenizer reads: .*tokenizer: byte"):
        load_text_corpus(DatasetConfig(kind="text", path="latin.txt"), tmp_path)
    corpus = load_text_corpus(DatasetConfig(kind="text", path="latin.txt", tokenizer="byte", val_fraction=0.25), tmp_path)
    assert torch.cat([corpus.train, corpus.val]).tolist() == list(data)


def test_aligned_windows_are_a_permutation_fixed_by_seed_and_epoch():
    tokens = torch.arange(161)
    windows = TokenWindows(tokens, block_size=8, seed=7)

    def order(epoch: int) -> list[int]:
        windows.set_epoch(epoch)
        return [int(windows[i][0][0]) // 8 for i in range(len(windows))]

    assert sorted(order(0)) == list(range(20))
    assert order(0) == order(0) and order(0) != order(1)
    inputs, targets = windows[3]
    assert torch.equal(targets[:-1], inputs[1:])  # targets are the inputs shifted by one token


def test_random_windows_start_anywhere_and_are_fixed_by_seed_epoch_and_index():
    tokens = torch.arange(161)
    windows = TokenWindows(tokens, block_size=8, seed=7, random_offsets=True)

    def starts(epoch: int) -> list[int]:
        windows.set_epoch(epoch)
        return [int(windows[i][0][0]) for i in range(len(windows))]

    assert len(starts(0)) == 20 and all(0 <= s <= 161 - 9 for s in starts(0))
    assert any(s % 8 for s in starts(0))  # not only the aligned windows
    assert starts(0) == starts(0) and starts(0) != starts(1)
    inputs, targets = windows[5]
    assert len(inputs) == 8 and torch.equal(targets[:-1], inputs[1:])
    # An epoch trimmed to whole steps keeps the draws of the untrimmed one (resume on another
    # process count trims differently).
    trimmed = TokenWindows(tokens, block_size=8, seed=7, multiple_of=6, random_offsets=True)
    trimmed.set_epoch(1)
    assert [int(trimmed[i][0][0]) for i in range(len(trimmed))] == starts(1)[:18]


def test_evaluation_with_no_eval_batches_reads_every_validation_window_once_in_order():
    spec = job_spec(**{"model.block_size": 8, "training.micro_batch_size": 3, "training.eval_batches": None})
    val = torch.arange(100)  # 12 whole windows of 8 (+1 target) tokens
    starts = [int(x[0]) for inputs, _ in eval_dataloader(val, spec) for x in inputs]
    assert starts == list(range(0, 96, 8))


def test_evaluation_reads_eval_batches_of_windows_spread_over_the_whole_validation_split():
    # The start of a split is no fair sample of it: the windows are spread evenly, the same for any seed.
    overrides = {"model.block_size": 8, "training.micro_batch_size": 3, "training.eval_batches": 2}
    spec = job_spec(**overrides)
    val = torch.arange(100)  # 12 windows

    def starts(loader) -> list[int]:
        return [int(x[0]) for inputs, _ in loader for x in inputs]

    assert [len(inputs) for inputs, _ in eval_dataloader(val, spec)] == [3, 3]
    assert starts(eval_dataloader(val, spec)) == [0, 16, 32, 48, 64, 80]
    assert starts(eval_dataloader(val, job_spec(**overrides, **{"training.seed": 9}))) == [0, 16, 32, 48, 64, 80]
    # The last evaluation, and an eval_batches that covers the split, read every window once.
    assert starts(eval_dataloader(val, spec, whole=True)) == list(range(0, 96, 8))
    assert starts(eval_dataloader(val, job_spec(**{**overrides, "training.eval_batches": 5}))) == list(range(0, 96, 8))
