"""The GPU defaults that also run on the CPU learn what the plain settings do: the fused AdamW
kernel (one kernel for every parameter's update) against the per-tensor loop."""

from __future__ import annotations

import pytest

from tests.helpers import job_spec
from tests.training.support import run_training, write_corpus


def test_the_fused_optimizer_trains_as_the_unfused_one(tmp_path):
    data_root = tmp_path / "data"
    name = write_corpus(data_root)
    overrides = {"dataset.path": name, "training.max_steps": 8, "training.eval_every": 8, "checkpoint.every_steps": None}
    plain = run_training(job_spec(**overrides, **{"optimizer.fused": False}), data_root, tmp_path / "plain")
    fused = run_training(job_spec(**overrides, **{"optimizer.fused": True}), data_root, tmp_path / "fused")
    # The same float operations in another order: equal to rounding, not bit for bit.
    assert fused.series("train_loss") == pytest.approx(plain.series("train_loss"), rel=1e-5)
    assert fused.steps[8]["eval_loss"] == pytest.approx(plain.steps[8]["eval_loss"], rel=1e-5)
