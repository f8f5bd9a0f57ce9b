"""Checkpoint directories: written whole under a temporary name, then renamed into place.

    step-00000500/
      model.safetensors     unwrapped, consolidated weights: load_file() + load_state_dict() into a fresh GPT
                            (a custom job's models by name: `generator.0.weight`, `discriminator.0.weight`, …)
      state/                accelerator.save_state(): model, optimizer, scheduler, RNG of every process
      trainer_state.json    where the loop was: step, epoch, batch index within the epoch
      spec.json, tokenizer.json (none for a custom job), labels.json (classifiers), config.json (`hf` models)
      manifest.json         sha256 and size of every other file
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from api_schemas import JobSpec
from api_schemas.manifest import MODEL_FILE, write_manifest
from workers.training.data import Tokenizer
from workers.training.model import build_model
from workers.training.reporter import Reporter


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


class CheckpointWriter:
    """Saves checkpoints, finishing each in the background so that training goes on meanwhile.

    save() blocks only for what must match its step: Accelerate's save_state on every process (the
    format resume loads; on the CPU it writes into the page cache as fast as any copy of the state
    would be made) and a CPU copy of the weights. The main process then writes model.safetensors
    from that copy, the JSON files and the manifest (a sha256 of every file, the slowest part), and
    renames the directory into place, in a thread. The training thread reports the checkpoint at
    the next report_finished() once it is complete (reporters write from one thread only), or
    at finish(). Only one is ever in flight: save() and finish() wait for the previous one first,
    so the loop never starts a second save, nor exits, while one is being written. A crash
    meanwhile leaves only the `.tmp-` staging directory, never reported.
    """

    def __init__(
        self, accelerator: Accelerator, run_dir: Path, spec: JobSpec, reporter: Reporter,
        tokenizer: Tokenizer | None = None, labels: list[str] | None = None,
    ):
        self.accelerator, self.run_dir, self.spec, self.reporter = accelerator, run_dir, spec, reporter
        self.tokenizer, self.labels = tokenizer, labels
        self._pending: tuple[int, Path, threading.Thread] | None = None
        self._error: BaseException | None = None

    def save(self, model: torch.nn.Module | dict[str, torch.nn.Module], trainer_state: dict) -> Path | None:
        """Start a complete checkpoint (every process takes part); returns on the main process the
        path it will have. Several models (a dict by name) go into one model.safetensors, each
        tensor's name prefixed with its model's."""
        self.finish()
        accelerator, step = self.accelerator, trainer_state["step"]
        root = self.run_dir / "checkpoints"
        final, staging = root / checkpoint_name(step), root / f".tmp-{checkpoint_name(step)}"
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(staging / "state"))
        accelerator.wait_for_everyone()  # every process's files are written before the main process hashes them
        if not accelerator.is_main_process:
            if accelerator.is_local_main_process:
                # Another node of a multi-node job (its own run dir): only node 0's copy is kept (the
                # RNG states written here are not needed to resume, the loop reseeds per step).
                shutil.rmtree(staging, ignore_errors=True)
            return None
        models = model if isinstance(model, dict) else {"": model}
        weights = {
            # A copy: training changes the weights in place from the next step on. Distinct tensors
            # also for tied weights, which safetensors refuses to save as two names of one storage.
            f"{prefix}.{name}" if prefix else name: tensor.detach().to("cpu", copy=True).contiguous()
            for prefix, each in models.items()
            for name, tensor in accelerator.unwrap_model(each, keep_torch_compile=False).state_dict().items()
        }
        texts = {"trainer_state.json": json.dumps(trainer_state), "spec.json": self.spec.model_dump_json()}
        for each in models.values():  # e.g. an `hf` model's config.json: the checkpoint is a transformers model directory
            texts.update(getattr(accelerator.unwrap_model(each), "checkpoint_files", dict)())
        if self.tokenizer is not None:
            texts["tokenizer.json"] = json.dumps(self.tokenizer.to_json())
        if self.labels is not None:  # a classifier's label names, by label id
            texts["labels.json"] = json.dumps(self.labels)
        thread = threading.Thread(target=self._write, args=(staging, final, step, weights, texts), daemon=True)
        self._pending = (step, final, thread)
        thread.start()
        return final

    def _write(self, staging: Path, final: Path, step: int, weights: dict[str, torch.Tensor], texts: dict[str, str]) -> None:
        try:
            save_file(weights, staging / MODEL_FILE)
            for name, text in texts.items():
                (staging / name).write_text(text)
            write_manifest(staging, step)
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
        except BaseException as exc:  # raised in the training thread by report_finished()
            self._error = exc

    def report_finished(self) -> None:
        """Report the checkpoint in flight if it is complete (main process; a no-op elsewhere)."""
        if self._pending is None or self._pending[2].is_alive():
            return
        step, final, thread = self._pending
        self._pending = None
        thread.join()
        if self._error is not None:
            raise RuntimeError(f"writing the checkpoint of step {step} failed") from self._error
        self.reporter.checkpoint(step, final)
        if not self.reporter.takes_checkpoints:
            prune_checkpoints(self.run_dir, self.spec.checkpoint.keep_last)

    def finish(self) -> None:
        """Wait for the checkpoint in flight, if any, and report it."""
        if self._pending is not None:
            self._pending[2].join()
            self.report_finished()


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` local checkpoints (run outside a worker, nobody else cleans up)."""
    for old in sorted((run_dir / "checkpoints").glob("step-*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def load_model(spec: JobSpec, vocab_size: int, weights: Path, data_root: Path | None = None) -> torch.nn.Module:
    """A fresh model of the spec with weights from a model.safetensors file (never pickle);
    `data_root` holds an `hf` model's `path`."""
    model = build_model(spec.model, vocab_size, data_root)
    model.load_state_dict(load_file(str(weights)))
    return model.eval()


def load_model_from_checkpoint(checkpoint: Path, data_root: Path | None = None) -> tuple[torch.nn.Module, Tokenizer, JobSpec]:
    """Model, tokenizer and spec from a checkpoint directory as written above."""
    spec = JobSpec.model_validate_json((checkpoint / "spec.json").read_text())
    tokenizer = Tokenizer.from_json(json.loads((checkpoint / "tokenizer.json").read_text()))
    return load_model(spec, tokenizer.vocab_size, checkpoint / MODEL_FILE, data_root), tokenizer, spec
