"""Gradient clipping: grad_norm is reported before clipping, and the step uses the clipped gradient."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import job_spec
from tests.training.support import reference_training, run_training

CLIP, STEPS = 1e-3, 3


def sgd_spec(clip: float | None):
    # SGD (momentum 0.9) without weight decay: the update is proportional to the gradient, so
    # clipping shows in how far the weights move (AdamW's update is nearly scale-free).
    return job_spec(**{
        "optimizer.name": "sgd", "optimizer.lr": 0.5, "optimizer.weight_decay": 0.0, "schedule.name": "constant",
        "schedule.warmup_steps": 0, "training.grad_clip_norm": clip, "training.max_steps": STEPS,
        "training.eval_every": STEPS, "checkpoint.every_steps": None,
    })


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(((a[name] - b[name]).double() ** 2).sum().item() for name in b) ** 0.5


def test_grad_norm_is_reported_before_clipping_and_the_step_uses_the_clipped_gradient(data_root, tmp_path):
    clipped = run_training(sgd_spec(CLIP), data_root, tmp_path / "clipped")
    unclipped = run_training(sgd_spec(None), data_root, tmp_path / "unclipped")
    ref_clipped = reference_training(sgd_spec(CLIP), data_root, STEPS)
    ref_unclipped = reference_training(sgd_spec(None), data_root, STEPS)

    # The reported norm is the norm of the gradient before clipping, far above the limit.
    assert clipped.series("grad_norm") == pytest.approx(ref_clipped.grad_norm, rel=1e-5)
    assert min(clipped.series("grad_norm")) > 100 * CLIP
    assert clipped.steps[1]["grad_norm"] == pytest.approx(unclipped.steps[1]["grad_norm"], rel=1e-6)  # same first batch
    assert unclipped.series("grad_norm") == pytest.approx(ref_unclipped.grad_norm, rel=1e-5)

    # The weights are those of the clipped reference, which moved ~1000x less than without clipping.
    weights, initial = clipped.final_weights(), ref_clipped.initial
    for name in ref_clipped.final:
        torch.testing.assert_close(weights[name], ref_clipped.final[name], rtol=1e-5, atol=1e-7, msg=name)
    moved_clipped, moved_unclipped = distance(weights, initial), distance(unclipped.final_weights(), initial)
    assert 0 < moved_clipped < 0.01 * moved_unclipped
    assert distance(weights, ref_clipped.final) < 1e-3 * moved_clipped


def test_grad_clip_value_bounds_every_gradient_element(data_root, tmp_path):
    # Plain SGD for one step at a constant lr: each parameter moves by lr × its (clamped) gradient.
    spec = job_spec(**{
        "optimizer.name": "sgd", "optimizer.lr": 0.1, "optimizer.weight_decay": 0.0, "schedule.name": "constant",
        "schedule.warmup_steps": 0, "training.grad_clip_norm": None, "training.grad_clip_value": 1e-4, "training.max_steps": 1,
        "checkpoint.every_steps": None,
    })
    engine = run_training(spec, data_root, tmp_path / "run")
    initial = reference_training(spec, data_root, 0).initial
    moved = max((engine.final_weights()[name] - initial[name]).abs().max().item() for name in initial)
    # Unclamped, the largest move would be ~lr × |grad| ≈ 1e-2; clamped it is lr × 1e-4, give or
    # take a float32 ulp of the largest weights (LayerNorm's, near 1.0: 1.2e-7).
    assert 0 < moved <= 0.1 * 1e-4 + 2.4e-7
    assert engine.steps[1]["grad_norm"] > 1e-3  # reported before clamping
