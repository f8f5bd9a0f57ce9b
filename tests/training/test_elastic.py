"""Elastic resume: a checkpoint written by N processes resumes on M ≠ N with the same optimizer
steps (accumulation × N/M, each global batch split across the ranks there are) for ddp and fsdp."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from api_schemas.manifest import MODEL_FILE
from tests.helpers import job_spec
from tests.training.support import checkpoints_of, launched, metrics_of, run_training, write_corpus
from tests.training.test_sharding import relative_difference
from workers.training import SpecError
from workers.training.elastic import accumulation_steps

STEPS, HALF = 40, 20
# Measured at step 40, as the largest over weight tensors of max |difference| / max |weight|: ddp 0
# both ways (2 → 1 and 1 → 2), fsdp 9.4e-8 (2 → 1) and 4.5e-8 (1 → 2), its reduce-scatter summing in
# another order.
RTOL = 1e-5


def spec_for(name: str, strategy: str, processes: int, accumulation: int):
    """Micro-batches of 6 and an optimizer step of 12 samples whatever the processes."""
    return job_spec(**{
        "dataset.path": name, "training.strategy": strategy, "training.micro_batch_size": 6, "resources.processes_per_node": processes,
        "training.gradient_accumulation_steps": accumulation, "training.max_steps": STEPS, "training.eval_every": HALF,
        "checkpoint.every_steps": HALF, "checkpoint.keep_last": 2,
    })


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_to_step_20_resumed_on_one_accumulating_twice_is_the_two_process_run_to_step_40(strategy, tmp_path):
    data_root = tmp_path / "data"
    spec = spec_for(write_corpus(data_root), strategy, processes=2, accumulation=1)
    two = launched(spec, data_root, tmp_path / "two")
    one = run_training(spec, data_root, tmp_path / "one", resume_from=checkpoints_of(two)[HALF])  # in this process: 1 of them

    state = json.loads((one.checkpoints[STEPS] / "trainer_state.json").read_text())
    two_state = json.loads((checkpoints_of(two)[STEPS] / "trainer_state.json").read_text())
    assert (state["processes"], two_state["processes"]) == (1, 2)
    assert state["batch_in_epoch"] == 2 * two_state["batch_in_epoch"]  # the same samples, twice the micro-batches each
    metrics = metrics_of(two)
    assert one.series("lr") == [metrics[step]["lr"] for step in range(HALF + 1, STEPS + 1)]
    assert one.series("train_loss") == pytest.approx([metrics[step]["train_loss"] for step in range(HALF + 1, STEPS + 1)], rel=1e-5)
    assert relative_difference(one.final_weights(), load_file(str(checkpoints_of(two)[STEPS] / MODEL_FILE))) < RTOL


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_process_to_step_20_resumed_on_two_accumulating_half_as_much_is_the_one_process_run_to_step_40(strategy, tmp_path):
    data_root = tmp_path / "data"
    spec = spec_for(write_corpus(data_root), strategy, processes=1, accumulation=2)
    one = run_training(spec, data_root, tmp_path / "one")
    two = launched(spec, data_root, tmp_path / "two", resume_from=one.checkpoints[HALF], processes=2)

    metrics = metrics_of(two)
    assert sorted(metrics) == list(range(HALF + 1, STEPS + 1))
    assert [metrics[step]["lr"] for step in sorted(metrics)] == one.series("lr")[HALF:]
    assert [metrics[step]["train_loss"] for step in sorted(metrics)] == pytest.approx(one.series("train_loss")[HALF:], rel=1e-5)
    assert relative_difference(load_file(str(checkpoints_of(two)[STEPS] / MODEL_FILE)), one.final_weights()) < RTOL


def test_an_optimizer_step_that_the_processes_cannot_split_into_whole_micro_batches_is_refused_with_the_reason(tmp_path):
    spec = spec_for("corpus.txt", "ddp", processes=2, accumulation=1)  # 12 samples a step
    assert [accumulation_steps(spec, processes) for processes in (1, 2)] == [2, 1]
    with pytest.raises(SpecError, match=r"training.gradient_accumulation_steps: an optimizer step of 12 samples .* on 3 processes"):
        accumulation_steps(spec, 3)
