"""Gradient accumulation: A micro-batches of m are one optimizer step on a batch of A×m."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import job_spec
from tests.training.support import micro_batches_per_epoch, reference_training, run_training, write_corpus
from workers.training import lr_at

STEPS = 3


def test_four_accumulated_micro_batches_of_8_train_like_one_batch_of_32(data_root, tmp_path):
    common = {"training.max_steps": STEPS, "training.eval_every": STEPS, "checkpoint.every_steps": None}
    accumulated_spec = job_spec(**common, **{"training.micro_batch_size": 8, "training.gradient_accumulation_steps": 4})
    single_spec = job_spec(**common, **{"training.micro_batch_size": 32, "training.gradient_accumulation_steps": 1})
    accumulated = run_training(accumulated_spec, data_root, tmp_path / "8x4")
    single = run_training(single_spec, data_root, tmp_path / "32x1")

    # Steps count optimizer steps, not micro-batches, and the schedule follows them.
    assert [step for step, _ in accumulated.metrics_log] == [1, 2, 3]
    assert [step for step, _ in single.metrics_log] == [1, 2, 3]
    assert accumulated.series("lr") == single.series("lr")
    assert accumulated.series("lr") == pytest.approx([lr_at(i, single_spec) for i in range(STEPS)], rel=1e-12)
    assert accumulated.series("train_loss") == pytest.approx(single.series("train_loss"), rel=1e-6)
    assert accumulated.series("grad_norm") == pytest.approx(single.series("grad_norm"), rel=1e-5)

    a, b = accumulated.final_weights(), single.final_weights()
    assert a.keys() == b.keys()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)

    # And both are what a plain PyTorch loop over the same 32 samples a step computes.
    reference = reference_training(single_spec, data_root, STEPS)
    assert single.series("train_loss") == pytest.approx(reference.train_loss, rel=1e-6)
    for name in reference.final:
        torch.testing.assert_close(b[name], reference.final[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not all(torch.equal(reference.initial[name], b[name]) for name in b)  # it did train


def test_an_epoch_holds_whole_accumulation_windows_so_every_step_gets_a_full_gradient(tmp_path):
    # 245 characters: 13 training windows of 16 tokens. With micro-batch 4 and accumulation 2 an
    # epoch takes 8 of them (2 micro-batches, one full window), never a short window whose loss
    # Accelerate would still divide by 2 (that halved the step's gradient before the epochs were trimmed).
    data_root = tmp_path / "data"
    name = write_corpus(data_root, 245)
    spec = job_spec(**{
        "dataset.path": name, "training.micro_batch_size": 4, "training.gradient_accumulation_steps": 2,
        "training.max_steps": 3, "schedule.warmup_steps": 0, "training.eval_every": 3, "training.eval_batches": 1,
        "checkpoint.every_steps": None,
    })
    assert micro_batches_per_epoch(spec, data_root) == 2
    engine = run_training(spec, data_root, tmp_path / "run")
    reference = reference_training(spec, data_root, 3)

    # Every step: the reported loss is the window's mean, and its gradient is that loss's gradient.
    assert engine.series("train_loss") == pytest.approx(reference.train_loss, rel=1e-6)
    assert engine.series("grad_norm") == pytest.approx(reference.grad_norm, rel=1e-5)
    weights = engine.final_weights()
    for name in reference.final:
        torch.testing.assert_close(weights[name], reference.final[name], rtol=1e-5, atol=1e-6, msg=name)
