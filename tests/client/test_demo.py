"""The demo's own logic; the full run (`make demo`) needs the stack and the training engine."""

from __future__ import annotations

import pytest

from api_schemas import JobSpec
from stack.demo import REPO, DemoError, demo_spec, wipe_data_dir

EXAMPLE = REPO / "examples" / "shakespeare-char.json"


def test_max_steps_override_keeps_the_spec_valid():
    assert JobSpec.model_validate(demo_spec(EXAMPLE, None)).training.max_steps == 2000
    quick = JobSpec.model_validate(demo_spec(EXAMPLE, 50))  # the example's 100 warmup steps would not fit
    assert (quick.training.max_steps, quick.schedule.warmup_steps) == (50, 5)
    assert JobSpec.model_validate(demo_spec(EXAMPLE, 500)).schedule.warmup_steps == 100


def test_only_a_trainyard_data_dir_is_wiped(tmp_path):
    previous_run = tmp_path / "demo"
    previous_run.mkdir()
    (previous_run / "token").write_text("t")
    wipe_data_dir(previous_run)
    assert not previous_run.exists()

    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("…")
    with pytest.raises(DemoError, match="not a Trainyard data dir"):
        wipe_data_dir(precious)
    assert (precious / "thesis.tex").exists()
