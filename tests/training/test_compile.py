"""`training.compile`: the compiled loop learns what the eager one does and saves weights an
uncompiled model loads (no `_orig_mod.` prefix), with strategy `ddp` and `fsdp`. About 30 s each on 2 cores
with a cold inductor cache."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from api_schemas.manifest import MODEL_FILE
from tests.helpers import job_spec
from tests.training.support import checkpoints_of, launched, metrics_of, run_training, write_corpus
from workers.training import eval_dataloader, evaluate, load_model, load_text_corpus


def test_a_compiled_run_matches_eager_and_its_weights_load_into_an_uncompiled_model(tmp_path):
    data_root = tmp_path / "data"
    name = write_corpus(data_root, chars=50_000)
    overrides = {"dataset.path": name, "training.max_steps": 3, "training.eval_every": 3, "checkpoint.every_steps": None}
    eager = run_training(job_spec(**overrides), data_root, tmp_path / "eager")
    spec = job_spec(**overrides, **{"training.compile": True})
    compiled = run_training(spec, data_root, tmp_path / "compiled")
    # Inductor fuses and reorders float operations: equal to about 1e-6, not bit for bit.
    assert compiled.series("train_loss") == pytest.approx(eager.series("train_loss"), rel=1e-4)

    weights = compiled.checkpoints[3] / MODEL_FILE
    assert not any(name.startswith("_orig_mod.") for name in load_file(str(weights)))
    corpus = load_text_corpus(spec.dataset, data_root)
    model = load_model(spec, corpus.tokenizer.vocab_size, weights)  # strict load_state_dict
    assert evaluate(model, eval_dataloader(corpus.val, spec, whole=True)) == pytest.approx(compiled.steps[3]["eval_loss"], abs=1e-4)



def test_a_compiled_fsdp_run_on_two_processes_matches_the_eager_one_and_keeps_the_models_names(tmp_path):
    data_root = tmp_path / "data"
    name = write_corpus(data_root, chars=50_000)
    overrides = {
        "dataset.path": name, "training.strategy": "fsdp", "resources.processes_per_node": 2, "training.max_steps": 4,
        "training.eval_every": 4, "checkpoint.every_steps": None,
    }
    eager = launched(job_spec(**overrides), data_root, tmp_path / "eager")
    compiled = launched(job_spec(**overrides, **{"training.compile": True}), data_root, tmp_path / "compiled")
    # Each block compiled, then sharded: the same losses to inductor's reordering of float operations.
    losses = [[metrics_of(run)[step]["train_loss"] for step in range(1, 5)] for run in (eager, compiled)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    eager_weights, compiled_weights = (load_file(str(checkpoints_of(run)[4] / MODEL_FILE)) for run in (eager, compiled))
    assert compiled_weights.keys() == eager_weights.keys()  # no `_orig_mod.`: the weights load into an eager model
