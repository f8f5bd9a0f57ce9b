"""`training.compile`: the compiled loop learns what the eager one does and saves weights an
uncompiled model loads (no `_orig_mod.` prefix). About 30 s on 2 cores with a cold inductor cache."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from api_schemas.manifest import MODEL_FILE
from tests.helpers import job_spec
from tests.training.support import run_training, write_corpus
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
    assert evaluate(model, eval_dataloader(corpus.val, spec)) == pytest.approx(compiled.steps[3]["eval_loss"], abs=1e-4)
