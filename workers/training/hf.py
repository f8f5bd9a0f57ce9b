"""`hf` models: a Hugging Face `transformers` architecture behind the engine's model interface.

`model(ids, targets)` returns `(logits, loss)` as the built-in models do, so the loop, evaluation
and checkpoints treat it like them. The model trains on the dataset's char or byte ids: the engine
sets the vocabulary size (plus one padding id for classifiers) and the label count. Nothing is ever
downloaded: a model comes from a config dict or from a directory under the data root holding
config.json and optionally model.safetensors (never pickle).

`transformers` is the optional `hf` extra and is imported only when an `hf` job runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from api_schemas import HFModelConfig
from api_schemas.manifest import MODEL_FILE
from workers.training.data import SpecError


def import_transformers():
    """transformers, offline: a job never reaches a model hub."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import transformers
    except ImportError:
        raise SpecError("model.kind: `hf` models need the transformers package: pip install 'trainyard[hf]'") from None
    transformers.logging.set_verbosity_error()  # its warnings are about hub usage this engine never does
    return transformers


class HFModel(nn.Module):
    """A transformers model taking padded ids (classifiers, padding id `pad_id`) or token windows (causal LMs).

    It holds the transformers model's own submodules, not the model itself, so its state_dict has
    exactly the transformers names: a checkpoint's model.safetensors and config.json make a directory
    that `from_pretrained` reads, and that a later job can name as its `model.path`."""

    def __init__(self, model: nn.Module, task: str, pad_id: int | None):
        super().__init__()
        assert not model._parameters and not model._buffers, "every tensor of a transformers model lives in a submodule"
        for name, child in model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf", model)  # reachable, but not a submodule (its tensors would be named twice)
        self.task, self.pad_id = task, pad_id

    def train(self, mode: bool = True) -> HFModel:
        self.hf.training = mode  # the submodules are shared; the transformers model's own flag is not
        return super().train(mode)

    def checkpoint_files(self) -> dict[str, str]:
        """Files a checkpoint holds besides the weights: the transformers config."""
        return {"config.json": self.hf.config.to_json_string()}

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (per text, or per position), and the mean cross-entropy if `targets` is given:
        computed here, as for the built-in models, so every model's loss means the same."""
        if self.task == "classify":
            logits = self.hf(input_ids=idx, attention_mask=(idx != self.pad_id).long()).logits
            loss = None if targets is None else F.cross_entropy(logits, targets)
        else:
            logits = self.hf(input_ids=idx).logits
            loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build_hf_model(config: HFModelConfig, vocab_size: int, data_root: Path | None) -> HFModel:
    """A fresh model of `config.architecture` for a tokenizer of `vocab_size` ids."""
    transformers = import_transformers()
    model_class = getattr(transformers, config.architecture)
    weights = None
    if config.path is not None:
        directory = model_directory(config.path, data_root)
        hf_config = model_class.config_class.from_json_file(str(directory / "config.json"))
        if (directory / MODEL_FILE).is_file():
            weights = directory / MODEL_FILE
    else:
        hf_config = model_class.config_class()
    unknown = sorted(key for key in config.config if not hasattr(hf_config, key))
    if unknown:
        raise SpecError(f"model.config: {type(hf_config).__name__} has no {', '.join(map(repr, unknown))}")
    for key, value in config.config.items():
        setattr(hf_config, key, value)

    # Classifiers pad their texts with one id past the tokenizer's (as LabelledCorpus does).
    needed = vocab_size + 1 if config.task == "classify" else vocab_size
    if weights is None:
        hf_config.vocab_size = needed
        for special in ("bos_token_id", "eos_token_id"):  # the defaults name ids of a vocabulary not used here
            setattr(hf_config, special, None)
    elif hf_config.vocab_size < needed:
        raise SpecError(f"model.path: its vocab_size {hf_config.vocab_size} is smaller than the dataset's tokenizer needs ({needed})")
    pad_id = None
    if config.task == "classify":
        hf_config.num_labels = config.num_labels
        hf_config.pad_token_id = pad_id = vocab_size
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions is not None and positions < config.max_length:
        raise SpecError(f"model.max_length: {config.max_length} is more than the model's {positions} positions")

    try:
        model = model_class(hf_config)
    except (ValueError, TypeError, AttributeError) as exc:  # e.g. a width the head count does not divide
        raise SpecError(f"model.config: {type(hf_config).__name__} refused it: {exc}") from None
    if weights is not None:
        load_weights(model, weights)
    return HFModel(model, config.task, pad_id)


def model_directory(relative: str, data_root: Path | None) -> Path:
    if data_root is None:
        raise SpecError("model.path: a model directory needs the data root")
    root = data_root.resolve()
    directory = (root / relative).resolve()
    if not directory.is_relative_to(root):
        raise SpecError(f"model.path: {relative!r} resolves outside the data root")
    if not (directory / "config.json").is_file():
        raise SpecError(f"model.path: {relative!r} is not a directory with a config.json under the data root")
    return directory


def load_weights(model: nn.Module, weights: Path) -> None:
    """Strict, except for tied weights a file may hold once (an output layer sharing the input embedding)."""
    try:
        missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        raise SpecError(f"model.path: {MODEL_FILE} does not fit the config: {str(exc).splitlines()[-1].strip()}") from None
    shared = {tensor.data_ptr() for name, tensor in model.state_dict().items() if name not in missing}
    untied = [name for name in missing if model.state_dict()[name].data_ptr() not in shared]
    if unexpected or untied:
        raise SpecError(f"model.path: {MODEL_FILE} does not fit the config: missing {untied[:5]}, unexpected {unexpected[:5]}")
