"""Learning-rate schedules: the lr each step reports is the closed form lr_at(step - 1)."""

from __future__ import annotations

import math

import pytest

from tests.helpers import job_spec
from tests.training.support import run_training
from workers.training import lr_at

PEAK, FLOOR, WARMUP, TOTAL = 1e-3, 1e-4, 3, 13  # 10 decay steps after 3 of warmup


def schedule_spec(name: str):
    return job_spec(**{
        "optimizer.lr": PEAK, "schedule.name": name, "schedule.warmup_steps": WARMUP, "schedule.min_lr": FLOOR,
        "training.max_steps": TOTAL, "training.eval_every": TOTAL, "checkpoint.every_steps": None,
    })


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_each_reported_lr_is_the_closed_form_of_its_step(data_root, tmp_path, name):
    spec = schedule_spec(name)
    run = run_training(spec, data_root, tmp_path / "run")
    assert [step for step, _ in run.metrics_log] == list(range(1, TOTAL + 1))
    # Reported steps are 1-based; lr_at takes the 0-based index of the optimizer step.
    assert [run.steps[step]["lr"] for step in range(1, TOTAL + 1)] == pytest.approx(
        [lr_at(step - 1, spec) for step in range(1, TOTAL + 1)], rel=1e-12
    )
    # Linear warmup from PEAK/(WARMUP+1), then the peak on the first step after warmup.
    assert [run.steps[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx([PEAK / 4, PEAK / 2, 3 * PEAK / 4, PEAK], rel=1e-12)


def test_closed_forms_by_hand():
    constant, linear, cosine = (schedule_spec(name) for name in ("constant", "linear", "cosine"))
    for spec in (constant, linear, cosine):
        assert lr_at(0, spec) == pytest.approx(PEAK / (WARMUP + 1), rel=1e-12)
        assert lr_at(WARMUP, spec) == pytest.approx(PEAK, rel=1e-12)
    assert all(lr_at(i, constant) == pytest.approx(PEAK, rel=1e-12) for i in range(WARMUP, TOTAL))

    # Halfway through the decay (index 3 + 5 of 10) both shapes are at the mean of peak and floor.
    assert lr_at(8, linear) == pytest.approx((PEAK + FLOOR) / 2, rel=1e-12)
    assert lr_at(8, cosine) == pytest.approx((PEAK + FLOOR) / 2, rel=1e-12)
    # The last optimizer step (index 12) runs one decay step above the floor, which the schedule
    # reaches at index TOTAL, just after training ends.
    assert lr_at(TOTAL - 1, linear) == pytest.approx(FLOOR + (PEAK - FLOOR) / 10, rel=1e-12)
    assert lr_at(TOTAL - 1, cosine) == pytest.approx(FLOOR + 0.5 * (1 + math.cos(0.9 * math.pi)) * (PEAK - FLOOR), rel=1e-12)
    assert lr_at(TOTAL - 1, cosine) < 1.25 * FLOOR
    assert lr_at(TOTAL, linear) == pytest.approx(FLOOR, rel=1e-12)
    assert lr_at(TOTAL, cosine) == pytest.approx(FLOOR, rel=1e-12)
    # Decay is monotone.
    for spec in (linear, cosine):
        values = [lr_at(i, spec) for i in range(WARMUP, TOTAL + 1)]
        assert values == sorted(values, reverse=True)
