import pytest
from pydantic import ValidationError

from api_schemas import JobSpec, field_location
from tests.helpers import EXAMPLE_SPEC, classifier_spec, spec_dict


def errors_of(spec: dict) -> list[tuple[tuple, str]]:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(spec)
    return [(field_location(error["loc"]), error["msg"]) for error in info.value.errors()]


def test_the_readme_example_spec_is_accepted_as_written():
    spec = JobSpec.model_validate(EXAMPLE_SPEC)
    assert spec.model.n_embd == 128 and spec.training.max_steps == 2000
    assert spec.effective_batch_size == 12
    assert spec.warmup_steps == 100


def test_effective_batch_counts_accumulation_and_every_process():
    spec = JobSpec.model_validate(
        spec_dict(**{"training.micro_batch_size": 8, "training.gradient_accumulation_steps": 4, "resources.processes_per_node": 2})
    )
    assert spec.effective_batch_size == 8 * 4 * 2


def test_default_warmup_is_ten_percent_of_steps():
    spec = JobSpec.model_validate(spec_dict(**{"schedule.warmup_steps": None, "training.max_steps": 500}))
    assert spec.warmup_steps == 50


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"model.kind": "resnet"}, ("model",), "using 'kind'"),  # tags: 'gpt', 'mlp'
        ({"model.n_embd": 130}, ("model",), "n_embd (130) must be divisible by n_head (4)"),
        ({"training.max_steps": -5}, ("training", "max_steps"), "greater than or equal to 1"),
        ({"training.precision": "fp8"}, ("training", "precision"), "'no', 'fp16' or 'bf16'"),
        ({"training.stall_timeout_s": 0}, ("training", "stall_timeout_s"), "greater than 0"),
        ({"dataset.path": "../etc/passwd"}, ("dataset", "path"), "must not contain '..'"),
        ({"dataset.path": "/etc/passwd"}, ("dataset", "path"), "relative path"),
        ({"optimizer.betas": [0.9, 1.5]}, ("optimizer", "betas"), "each beta must be in [0, 1)"),
        ({"training.learning_rate": 0.1}, ("training", "learning_rate"), "Extra inputs are not permitted"),
        ({"training.precision": "fp16"}, (), "fp16 needs device 'cuda'"),
        ({"schedule.warmup_steps": 5000}, (), "warmup_steps must be smaller than training.max_steps"),
        ({"training.grad_clip_value": 0.5}, (), "set grad_clip_norm or grad_clip_value, not both"),
        ({"training.strategy": "zero3"}, ("training", "strategy"), "'ddp' or 'fsdp'"),
        ({"training.fsdp": {"param_dtype": "bfloat16"}}, (), "training.fsdp: options of strategy `fsdp`"),
        ({"training.strategy": "fsdp", "training.fsdp": {"param_dtype": "float16"}}, ("training", "fsdp", "param_dtype"), "'float32' or 'bfloat16'"),
        ({"training.strategy": "fsdp", "training.precision": "bf16"}, (), "training.precision: with strategy `fsdp`"),
        ({"training.strategy": "fsdp", "resources.nodes": 2}, (), "resources.nodes: strategy `fsdp`"),
        ({"training.strategy": "fsdp", "training.fsdp": {"cpu_offload": True}}, (), "training.fsdp.cpu_offload: needs device 'cuda'"),
        ({"checkpoint.best_mode": "max"}, ("checkpoint",), "rank checkpoints for keep_best: set keep_best: true"),
        ({"checkpoint.keep_best": True, "checkpoint.best_metric": "eval_accuracy"}, (),
         "checkpoint.best_metric: the built-in loop evaluates eval_loss for this model, not 'eval_accuracy'"),
        ({"checkpoint.keep_best": True, "checkpoint.best_mode": "highest"}, ("checkpoint", "best_mode"), "'min' or 'max'"),
    ],
)
def test_invalid_specs_name_the_field_and_the_reason(overrides, field, reason):
    errors = errors_of(spec_dict(**overrides))
    assert any(loc[: len(field)] == field and reason in msg for loc, msg in errors), errors


def test_custom_and_hf_models_name_their_fields_without_the_union_tag():
    custom = {**spec_dict(**{"model": {"kind": "custom", "entrypoint": "plugins/gan:train"}})}
    assert errors_of(custom)[0][0] == ("model", "entrypoint")
    hf = spec_dict(**{"model": {"kind": "hf", "architecture": "GPT2LMHeadModel", "num_labels": 2}})
    assert errors_of(hf) == [(("model",), "Value error, num_labels: GPT2LMHeadModel is a language model, it has no labels")]
    del custom["dataset"]
    custom["model"]["entrypoint"] = "gan_example:train"
    assert JobSpec.model_validate(custom).dataset is None  # a custom loop may make its own data


@pytest.mark.parametrize(("overrides", "compiled", "fused"), [
    ({}, False, False),  # the CPU: compiling a small model costs more than it saves
    ({"resources": {"device": "cuda"}}, True, True),
    ({"resources": {"device": "cuda"}, "training.strategy": "fsdp"}, False, True),  # fsdp compiles when asked, not by default (unmeasured on a GPU)
    ({"resources": {"device": "cuda"}, "training.compile": False, "optimizer.fused": False}, False, False),
    ({"training.compile": True, "optimizer.fused": True}, True, True),
])
def test_the_gpu_defaults_are_chosen_by_device_and_recorded_in_the_spec(overrides, compiled, fused):
    spec = JobSpec.model_validate(spec_dict(**{"training.compile": None, **overrides}))  # the example says false
    assert (spec.training.compile, spec.optimizer.fused) == (compiled, fused)
    stored = JobSpec.model_validate_json(spec.model_dump_json())  # as the job row keeps it
    assert (stored.training.compile, stored.optimizer.fused) == (compiled, fused)


def test_a_script_jobs_spec_is_shown_without_the_settings_its_script_decides():
    spec = JobSpec.model_validate(
        {"name": "mine", "script": {"entrypoint": "train.py", "code": {"upload_id": 1}}, "training": {"max_steps": 30, "precision": "bf16"}}
    )
    shown = spec.model_dump(mode="json", exclude_none=True)
    assert "schedule" not in shown  # no cosine schedule, seed or eval_every cluttering `trainyard spec` and compare
    assert shown["training"] == {"max_steps": 30, "gradient_accumulation_steps": 1, "precision": "bf16"}
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec  # read back (stored, fetched): the same spec
    built_in = JobSpec.model_validate(spec_dict())
    assert "schedule" in built_in.model_dump() and "seed" in built_in.model_dump()["training"]


def test_keep_best_ranks_by_a_metric_the_job_reports():
    # A classifier's built-in evaluation reports its accuracy; a script may rank by anything it logs.
    best = {"checkpoint.keep_best": True, "checkpoint.best_metric": "eval_accuracy", "checkpoint.best_mode": "max"}
    policy = JobSpec.model_validate(classifier_spec(**best)).checkpoint
    assert policy.better(0.9, 0.8) and not policy.better(0.7, 0.8) and policy.better(0.1, None)
    assert JobSpec.model_validate(spec_dict(**{"checkpoint.keep_best": True})).checkpoint.better(1.2, 1.5)  # eval_loss, lowest best
    script = {"name": "s", "script": {"entrypoint": "train.py", "code": {"path": "proj"}},
              "checkpoint": {"keep_best": True, "best_metric": "val/acc", "best_mode": "max"}}
    assert JobSpec.model_validate(script).checkpoint.best_metric == "val/acc"
