"""Checkpoint directories: written whole under a temporary name, then renamed into place.

    step-00000500/
      model.safetensors     unwrapped, consolidated weights: load_file() + load_state_dict() into a fresh GPT
      state/                accelerator.save_state(): model, optimizer, scheduler, RNG of every process
      trainer_state.json    where the loop was: step, epoch, batch index within the epoch
      spec.json, tokenizer.json
      manifest.json         sha256 and size of every other file
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from api_schemas import JobSpec
from api_schemas.manifest import MODEL_FILE, write_manifest
from workers.training.data import Tokenizer
from workers.training.model import build_model


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(
    accelerator: Accelerator, model: torch.nn.Module, run_dir: Path, trainer_state: dict, spec: JobSpec, tokenizer: Tokenizer,
    labels: list[str] | None = None,
) -> Path | None:
    """Write a complete checkpoint (every process takes part); returns its path on the main process."""
    step = trainer_state["step"]
    root = run_dir / "checkpoints"
    final, staging = root / checkpoint_name(step), root / f".tmp-{checkpoint_name(step)}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging / "state"))
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model, keep_torch_compile=False).state_dict()
        # clone(): tied weights share storage, which safetensors refuses to save as two names.
        save_file({name: tensor.detach().cpu().clone().contiguous() for name, tensor in weights.items()}, staging / MODEL_FILE)
        (staging / "trainer_state.json").write_text(json.dumps(trainer_state))
        (staging / "spec.json").write_text(spec.model_dump_json())
        (staging / "tokenizer.json").write_text(json.dumps(tokenizer.to_json()))
        if labels is not None:  # a classifier's label names, by label id
            (staging / "labels.json").write_text(json.dumps(labels))
        write_manifest(staging, step)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process and not accelerator.is_main_process:
        # Another node of a multi-node job: only node 0's copy is kept (the RNG states written
        # here are not needed to resume, the loop reseeds per step).
        shutil.rmtree(staging, ignore_errors=True)
    return final if accelerator.is_main_process else None


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` local checkpoints (run outside a worker, nobody else cleans up)."""
    for old in sorted((run_dir / "checkpoints").glob("step-*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def load_model(spec: JobSpec, vocab_size: int, weights: Path) -> torch.nn.Module:
    """A fresh model of the spec with weights from a model.safetensors file (never pickle)."""
    model = build_model(spec.model, vocab_size)
    model.load_state_dict(load_file(str(weights)))
    return model.eval()


def load_model_from_checkpoint(checkpoint: Path) -> tuple[torch.nn.Module, Tokenizer, JobSpec]:
    """Model, tokenizer and spec from a checkpoint directory as written above."""
    spec = JobSpec.model_validate_json((checkpoint / "spec.json").read_text())
    tokenizer = Tokenizer.from_json(json.loads((checkpoint / "tokenizer.json").read_text()))
    return load_model(spec, tokenizer.vocab_size, checkpoint / MODEL_FILE), tokenizer, spec
