"""Small builders shared by tests."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from api_schemas import JobSpec

EXAMPLE_SPEC = json.loads((Path(__file__).resolve().parent.parent / "examples" / "shakespeare-char.json").read_text())


def spec_dict(**overrides) -> dict:
    """The README's example spec with dotted-path overrides, e.g. spec_dict(**{"training.max_steps": 10})."""
    spec = copy.deepcopy(EXAMPLE_SPEC)
    for dotted, value in overrides.items():
        target = spec
        *parents, leaf = dotted.split(".")
        for key in parents:
            target = target[key]
        target[leaf] = value
    return spec


def tiny_spec(**overrides) -> dict:
    """A job that trains in a few seconds on one CPU core."""
    base = {
        "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16,
        "training.max_steps": 12, "training.micro_batch_size": 4, "training.eval_every": 6, "training.eval_batches": 4,
        "schedule.warmup_steps": 2, "checkpoint.every_steps": 6, "checkpoint.keep_last": 2, "max_restarts": 1,
    }
    return spec_dict(**{**base, **overrides})


def job_spec(**overrides) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(**overrides))
