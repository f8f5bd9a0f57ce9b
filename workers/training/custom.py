"""`custom` jobs: a function from the worker's plugin directory runs the training, with a prepared context.

    {"model": {"kind": "custom", "entrypoint": "gan_example:train", "config": {...}}, ...}

loads `<plugin dir>/gan_example.py` (only from there: the name is one identifier, and a file that
resolves elsewhere, through a symlink say, is refused) and calls `train(context)`. The context gives
what the built-in loop has and a custom one needs: an Accelerator set up from the spec, the job's
dataset if it names one, `dataloader` to batch and shard any dataset across the processes, `log_metric`, `save_checkpoint` (the same checkpoint format, manifest
and all, through the same reporter), `load_checkpoint` for `resume_from`, `should_stop` for
preemption, and `skip_steps` after the loss guard rolled the job back (the data is the function's
own, so passing over the spike's batches is too). examples/plugins/gan_example.py is a complete example.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from accelerate.utils import set_seed

from api_schemas import JobSpec
from workers.training.checkpoint import CheckpointWriter, load_trainer_state
from workers.training.data import SpecError, TextCorpus, load_text_corpus, read_texts
from workers.training.loop import TrainResult, make_accelerator, pinned, sigterm_requests, stop_votes
from workers.training.reporter import Reporter


def load_entrypoint(entrypoint: str, plugin_dir: Path | None) -> Callable[[CustomContext], Any]:
    """The function `module:function` names, from `<plugin_dir>/module.py` and nowhere else."""
    module_name, _, function_name = entrypoint.partition(":")
    if plugin_dir is None:
        raise SpecError("model.entrypoint: this worker has no plugin directory (TRAINYARD_PLUGIN_DIR)")
    if not module_name.isidentifier():  # the spec allows nothing else; a hand-made spec file might
        raise SpecError(f"model.entrypoint: {module_name!r} is not a module name")
    root = plugin_dir.resolve()
    path = (root / f"{module_name}.py").resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise SpecError(f"model.entrypoint: no {module_name}.py in the plugin directory")
    module_spec = importlib.util.spec_from_file_location(f"trainyard_plugins.{module_name}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # registered as an import would be: dataclasses and typing look modules up there
    module_spec.loader.exec_module(module)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise SpecError(f"model.entrypoint: {module_name}.py has no function {function_name!r}")
    return function


@dataclass
class CustomContext:
    """What a custom training function is given. Every process of the job calls it with its own."""

    accelerator: Accelerator
    spec: JobSpec
    config: dict[str, Any]  # model.config of the spec, as written
    run_dir: Path
    resume_from: Path | None
    # The job's dataset, if it names one: a TextCorpus (train/val token tensors and the tokenizer)
    # for `text`, (texts, labels) for `jsonl`/`csv`/`hf_disk`.
    dataset: TextCorpus | tuple[list[str], list[str]] | None
    reporter: Reporter
    checkpoints: CheckpointWriter
    # After a rollback (workers/loss_guard.py): the job resumed from its checkpoint before a loss spike,
    # and the batches of this many steps after that checkpoint's step are the spike's: go on past them
    # (a loader: accelerator.skip_first_batches; step-seeded data: an offset), and keep where the data
    # stands in the checkpoints' `state` (later resumes pass 0 here: those checkpoints are past the skip).
    skip_steps: int = 0
    models: dict[str, torch.nn.Module] = field(default_factory=dict)
    last_step: int = 0
    stopped: bool = False
    _stop_requested: list = field(default_factory=list)

    def register_model(self, name: str, model: torch.nn.Module) -> None:
        """Include `model` (prepared or not) in every checkpoint's model.safetensors, its tensors named `name.…`."""
        self.models[name] = model

    def dataloader(self, dataset: Dataset, shuffle: bool = True) -> DataLoader:
        """`dataset` (any map-style torch Dataset, e.g. `TokenWindows(context.dataset.train, 64)`)
        in batches of training.micro_batch_size, prepared: each process reads its own shard.
        Shuffled by training.seed (and the epoch: call `set_epoch` on it, as the built-in loop
        does), so every process, every run and a resumed run agree on the order; a shuffled loader
        drops the last, short batch."""
        generator = torch.Generator().manual_seed(self.spec.training.seed)
        loader = DataLoader(
            dataset, batch_size=self.spec.training.micro_batch_size, shuffle=shuffle, drop_last=shuffle, generator=generator,
            pin_memory=pinned(self.accelerator),
        )
        return self.accelerator.prepare(loader)

    def log_metric(self, step: int, values: dict[str, float]) -> None:
        """Report `values` (plain numbers) for `step`; only the main process's are sent, so log the same on every one."""
        self.last_step = max(self.last_step, step)
        if self.accelerator.is_main_process:
            self.reporter.metrics(step, {name: float(value) for name, value in values.items()})
            self.checkpoints.report_finished()

    def checkpoint_due(self, step: int) -> bool:
        """True at the spec's checkpoint.every_steps and at training.max_steps."""
        every = self.spec.checkpoint.every_steps
        return step >= self.spec.training.max_steps or bool(every and step % every == 0)

    def save_checkpoint(self, step: int, state: dict[str, Any] | None = None) -> Path | None:
        """A complete checkpoint (every process must call it): accelerator.save_state() of everything
        prepared, the registered models' weights, spec, manifest. `state` (JSON) comes back from
        load_checkpoint(). Returns once the state of this step is taken; the files are finished in the
        background (see CheckpointWriter). Returns the path it will have, on the main process.
        On the CPU the optimizers' parameters are still being copied until their next step(), which
        waits for the copy: change them only through an optimizer step until then."""
        if not self.models:
            raise RuntimeError("save_checkpoint: register_model() the models first")
        return self.checkpoints.save(self.models, {**(state or {}), "step": step})

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Restore everything prepared (models, optimizers, schedulers, RNG) from `resume_from`; returns
        the `state` given to save_checkpoint, with "step". None when the job starts fresh. Call it after
        accelerator.prepare()."""
        if self.resume_from is None:
            return None
        self.accelerator.load_state(str(self.resume_from / "state"))
        return load_trainer_state(self.resume_from)

    def should_stop(self) -> bool:
        """True once the job is asked to stop (preemption, a host going away): save a checkpoint and
        return. Every process must call it at the same points: they agree, so all stop at the same
        step. Ask once per step: a function that never asks is killed at the end of the grace period."""
        self.stopped = bool(stop_votes(self.accelerator, bool(self._stop_requested)).item() > 0)
        return self.stopped


def run_custom(
    spec: JobSpec, data_root: Path, run_dir: Path, reporter: Reporter, resume_from: Path | None, plugin_dir: Path | None,
    skip_steps: int = 0,
) -> TrainResult:
    function = load_entrypoint(spec.model.entrypoint, plugin_dir)
    accelerator = make_accelerator(spec)
    set_seed(spec.training.seed)
    with sigterm_requests() as stop_requested:
        context = CustomContext(
            accelerator, spec, spec.model.config, run_dir, resume_from, load_dataset(spec, data_root), reporter,
            CheckpointWriter(accelerator, run_dir, spec, reporter), skip_steps=skip_steps, _stop_requested=stop_requested,
        )
        function(context)
        context.checkpoints.finish()  # the last checkpoint is complete and reported before the process exits
    accelerator.end_training()
    preempted = context.stopped and context.last_step < spec.training.max_steps
    return TrainResult(step=context.last_step, preempted=preempted, last_eval_loss=None)


def load_dataset(spec: JobSpec, data_root: Path) -> TextCorpus | tuple[list[str], list[str]] | None:
    dataset = spec.dataset
    if dataset is None:
        return None
    return load_text_corpus(dataset, data_root) if dataset.kind == "text" else read_texts(dataset, data_root)
