"""`hf` models: transformers architectures train through the same loop as the built-in models, their
checkpoints reload into a fresh model of the same spec, and accumulation means what it means there."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from api_schemas import HFModelConfig
from api_schemas.jobs import HF_CAUSAL_LMS, HF_CLASSIFIERS
from api_schemas.manifest import MODEL_FILE
from tests.helpers import classifier_spec, job_spec
from tests.training.support import run_training, write_corpus
from workers.training import (
    SpecError, build_model, eval_dataloader, evaluate_metrics, load_labelled_corpus, load_model_from_checkpoint, load_text_corpus,
)

transformers = pytest.importorskip("transformers")

# Tiny and without dropout, so that runs compare exactly.
DISTILBERT = {
    "kind": "hf", "architecture": "DistilBertForSequenceClassification", "num_labels": 3, "max_length": 16,
    "config": {"n_layers": 1, "dim": 32, "n_heads": 2, "hidden_dim": 64, "dropout": 0.0, "attention_dropout": 0.0, "seq_classif_dropout": 0.0},
}
GPT2 = {
    "kind": "hf", "architecture": "GPT2LMHeadModel", "max_length": 16,
    "config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}


def test_the_allow_listed_architectures_are_transformers_classifiers_and_causal_lms():
    from transformers.models.auto import modeling_auto

    assert set(HF_CLASSIFIERS) <= set(modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values())
    assert set(HF_CAUSAL_LMS) <= set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def test_an_hf_classifier_learns_and_its_checkpoint_reloads_into_a_fresh_model_that_scores_the_same(labelled_root, tmp_path):
    overrides = {"training.max_steps": 40, "training.eval_every": 20, "checkpoint.every_steps": 40, "optimizer.lr": 0.01}
    spec = job_spec(**classifier_spec(model=DISTILBERT, **overrides))
    run = run_training(spec, labelled_root, tmp_path / "run")
    assert run.series("eval_accuracy")[-1] >= 0.9 and run.series("eval_loss")[-1] < run.series("eval_loss")[0]

    checkpoint = run.checkpoints[40]
    model, _, loaded_spec = load_model_from_checkpoint(checkpoint)  # strict load_state_dict into a fresh model
    assert isinstance(model.hf, transformers.DistilBertForSequenceClassification)
    corpus = load_labelled_corpus(loaded_spec.dataset, loaded_spec.model, labelled_root)
    metrics = evaluate_metrics(model, eval_dataloader(corpus.val, loaded_spec, whole=True))  # the last step's: the whole split
    assert metrics == pytest.approx({"eval_loss": run.steps[40]["eval_loss"], "eval_accuracy": run.steps[40]["eval_accuracy"]}, abs=1e-5)


def test_an_hf_causal_lm_trains_and_its_checkpoint_reproduces_the_reported_eval_loss(tmp_path):
    data_root = tmp_path / "data"
    name = write_corpus(data_root, 20_000)
    spec = job_spec(model=GPT2, **{"dataset.path": name, "training.max_steps": 30, "training.eval_every": 15,
                                             "checkpoint.every_steps": 30, "optimizer.lr": 0.01})
    run = run_training(spec, data_root, tmp_path / "run")
    assert run.series("train_loss")[-1] < run.series("train_loss")[0]
    assert {"tokens_per_s", "grad_norm", "lr"} <= set(run.steps[30])

    model, tokenizer, loaded_spec = load_model_from_checkpoint(run.checkpoints[30])
    assert isinstance(model.hf, transformers.GPT2LMHeadModel) and model.hf.config.vocab_size == tokenizer.vocab_size
    corpus = load_text_corpus(loaded_spec.dataset, data_root)
    assert evaluate_metrics(model, eval_dataloader(corpus.val, loaded_spec, whole=True))["eval_loss"] == pytest.approx(run.steps[30]["eval_loss"], abs=1e-5)

    # The checkpoint is a transformers model directory (config.json, model.safetensors under the
    # transformers names): from_pretrained reads it, and a later job can start from it as model.path.
    ids = corpus.val[:16].unsqueeze(0)
    pretrained = transformers.GPT2LMHeadModel.from_pretrained(run.checkpoints[30], local_files_only=True).eval()
    torch.testing.assert_close(pretrained(input_ids=ids).logits, model(ids)[0], rtol=0, atol=0)
    shutil.copytree(run.checkpoints[30], data_root / "from-job")
    continued = build_model(HFModelConfig(kind="hf", architecture="GPT2LMHeadModel", path="from-job", max_length=16), tokenizer.vocab_size, data_root)
    assert all(torch.equal(t, continued.state_dict()[name]) for name, t in model.state_dict().items())


def test_four_accumulated_micro_batches_of_8_train_an_hf_classifier_like_one_batch_of_32(labelled_root, tmp_path):
    common = {"training.max_steps": 3, "training.eval_every": 3, "checkpoint.every_steps": None}
    accumulated = run_training(
        job_spec(**classifier_spec(model=DISTILBERT, **common, **{"training.micro_batch_size": 8, "training.gradient_accumulation_steps": 4})),
        labelled_root, tmp_path / "8x4",
    )
    single = run_training(
        job_spec(**classifier_spec(model=DISTILBERT, **common, **{"training.micro_batch_size": 32, "training.gradient_accumulation_steps": 1})),
        labelled_root, tmp_path / "32x1",
    )
    assert accumulated.series("train_loss") == pytest.approx(single.series("train_loss"), rel=1e-6)
    assert accumulated.series("grad_norm") == pytest.approx(single.series("grad_norm"), rel=1e-5)
    a, b = accumulated.final_weights(), single.final_weights()
    assert a.keys() == b.keys() and any(name.startswith("distilbert.") for name in a)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_directory_under_the_data_root_starts_from_its_safetensors_weights(tmp_path):
    data_root = tmp_path / "data"
    directory = data_root / "models" / "tiny-gpt2"
    directory.mkdir(parents=True)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=80, n_positions=32)
    saved = transformers.GPT2LMHeadModel(config)
    (directory / "config.json").write_text(config.to_json_string())
    save_file({name: t.clone().contiguous() for name, t in saved.state_dict().items() if name != "lm_head.weight"}, directory / MODEL_FILE)

    model = build_model(HFModelConfig(kind="hf", architecture="GPT2LMHeadModel", path="models/tiny-gpt2", max_length=16), 65, data_root)
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(model.hf.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    assert model.hf.lm_head.weight.data_ptr() == model.hf.transformer.wte.weight.data_ptr()  # still tied

    too_big = HFModelConfig(kind="hf", architecture="GPT2LMHeadModel", path="models/tiny-gpt2", max_length=16)
    with pytest.raises(SpecError, match="model.path: its vocab_size 80"):
        build_model(too_big, 100, data_root)
    (directory / "config.json").write_text(json.dumps({**json.loads(config.to_json_string()), "n_embd": 64}))
    with pytest.raises(SpecError, match="does not fit the config"):
        build_model(too_big, 65, data_root)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"n_layer": 1, "n_embd": 32, "n_head": 2, "n_layers": 3}, "model.config: GPT2Config has no 'n_layers'"),
        ({"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 8}, "model.max_length: 16 is more than the model's 8 positions"),
    ],
)
def test_a_config_the_architecture_cannot_take_fails_naming_the_field(config, message):
    with pytest.raises(SpecError, match=message):
        build_model(HFModelConfig(kind="hf", architecture="GPT2LMHeadModel", config=config, max_length=16), 65)


def test_a_causal_lm_trains_on_the_ids_of_a_tokenizer_file_and_its_checkpoint_carries_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    data_root = tmp_path / "data"
    name = write_corpus(data_root, 20_000)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator([(data_root / name).read_text()], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    bpe.save(str(data_root / "tokenizer.json"))

    spec = job_spec(model=GPT2, **{"dataset.path": name, "dataset.tokenizer_file": "tokenizer.json",
                                             "training.max_steps": 4, "training.eval_every": 4, "checkpoint.every_steps": 4})
    run = run_training(spec, data_root, tmp_path / "run")
    model, tokenizer, loaded_spec = load_model_from_checkpoint(run.checkpoints[4])
    assert tokenizer.kind == "file" and model.hf.config.vocab_size == bpe.get_vocab_size() == 300
    text = "First Citizen: speak, speak."
    assert tokenizer.encode(text) == bpe.encode(text).ids and len(tokenizer.encode(text)) < len(text)
    corpus = load_text_corpus(loaded_spec.dataset, data_root)
    assert corpus.train[:50].tolist() == bpe.encode((data_root / name).read_text()).ids[:50]
    assert evaluate_metrics(model, eval_dataloader(corpus.val, loaded_spec, whole=True))["eval_loss"] == pytest.approx(run.steps[4]["eval_loss"], abs=1e-5)

    (data_root / "broken.json").write_text("{}")
    with pytest.raises(SpecError, match="dataset.tokenizer_file: not a tokenizer.json"):
        load_text_corpus(job_spec(**{"dataset.path": name, "dataset.tokenizer_file": "broken.json"}).dataset, data_root)


TINY_CONFIGS = {
    "Bert": {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32},
    "DistilBert": DISTILBERT["config"],
    "GPT2": GPT2["config"],
    "Llama": {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32},
    "GPTNeoX": {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32},
    "Qwen2": {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32},
    "Mistral": {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32},
}


@pytest.mark.parametrize("architecture", HF_CLASSIFIERS + HF_CAUSAL_LMS)
def test_every_allow_listed_architecture_gives_the_loop_logits_and_a_loss_it_can_train(architecture):
    family = next(name for name in sorted(TINY_CONFIGS, key=len, reverse=True) if architecture.startswith(name))
    classify = architecture in HF_CLASSIFIERS
    config = HFModelConfig(
        kind="hf", architecture=architecture, config=TINY_CONFIGS[family], max_length=8, num_labels=3 if classify else None
    )
    torch.manual_seed(0)
    model = build_model(config, 20)
    ids = torch.randint(20, (2, 8))
    if classify:
        ids[0, 5:] = 20  # the padding id, one past the tokenizer's
    targets = torch.tensor([0, 2]) if classify else torch.randint(20, (2, 8))
    logits, loss = model(ids, targets)
    assert logits.shape == ((2, 3) if classify else (2, 8, 20))
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).item())
    loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []
    if classify:  # padding changes nothing: the padded text scores as its first 5 ids alone
        model.eval()  # (without dropout)
        torch.testing.assert_close(model(ids[:1])[0], model(ids[:1, :5])[0], rtol=1e-4, atol=1e-5)


def test_an_hf_classifier_with_dropout_resumed_from_its_halfway_checkpoint_is_bit_identical(labelled_root, tmp_path):
    dropout = {**DISTILBERT["config"], "dropout": 0.1, "seq_classif_dropout": 0.2}
    spec = job_spec(**classifier_spec(model={**DISTILBERT, "config": dropout}, **{
        "training.max_steps": 8, "training.eval_every": 4, "checkpoint.every_steps": 4, "checkpoint.keep_last": 2,
    }))
    straight = run_training(spec, labelled_root, tmp_path / "straight")
    resumed = run_training(spec, labelled_root, tmp_path / "resumed", resume_from=straight.checkpoints[4])
    assert [step for step, _ in resumed.metrics_log] == [5, 6, 7, 8]
    for name in ("train_loss", "grad_norm", "eval_loss", "eval_accuracy"):
        assert resumed.series(name) == straight.series(name)[-len(resumed.series(name)):], name
    a, b = resumed.final_weights(), straight.final_weights()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
