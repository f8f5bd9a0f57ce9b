"""Checkpoint directories: written whole under a temporary name, then renamed into place.

    step-00000500/
      model.safetensors     unwrapped, consolidated weights: load_file() + load_state_dict() into a fresh GPT
                            (a custom job's models by name: `generator.0.weight`, `discriminator.0.weight`, …)
      state/                what accelerator.save_state() writes (load_state() resumes from it): model,
                            optimizer, scheduler, RNG of every process; with strategy `fsdp`, the model
                            and optimizer as every process's shards instead (DCP: .metadata, __<rank>_0.distcp)
      trainer_state.json    where the loop was: step, epoch, batch index within the epoch, and the
                            number of processes that batch index counts for; the loss guard's window;
                            the step's evaluation (eval_loss, eval_accuracy) if it evaluated, and the best
                            checkpoint.best_metric so far (checkpoint.keep_best)
      spec.json, tokenizer.json (none for a custom job), labels.json (classifiers), config.json (`hf` models)
      manifest.json         sha256 and size of every other file
"""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state, save_custom_state
from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME, DistributedType, save
from safetensors.torch import load_file, save_file

from api_schemas import CheckpointConfig, JobSpec
from api_schemas.manifest import MODEL_FILE, checkpoint_name, write_manifest
from workers.training.data import Tokenizer
from workers.training.model import build_model
from workers.training.reporter import Reporter
from workers.training.sharding import ShardedState, full_weights


log = logging.getLogger(__name__)


class StateSnapshot:
    """The tensors of a checkpoint copied into CPU buffers that are kept from one save to the next.

    Copying into memory already mapped is a plain memcpy (a fresh copy pays a page fault per 4 KiB,
    4× slower here), and on a GPU an asynchronous copy into pinned memory, ordered before the next
    step's kernels by the stream. Tensors sharing storage (tied weights) share a buffer, so the
    files written from a snapshot are those save_state writes from the live state."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def take(self, tree: Any, later: set[int] = frozenset()) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]], torch.cuda.Event | None]:
        """A copy of `tree` (dicts, lists and tuples of tensors and plain values). Tensors whose
        storage (data_ptr) is in `later` are left for copy_later(): (buffer, source) pairs. For a
        GPU copy, also the event to wait for before reading the snapshot."""
        taken: dict[tuple, torch.Tensor] = {}  # by storage: an alias is copied once
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []

        def copied(node: Any, path: tuple) -> Any:
            if isinstance(node, torch.Tensor):
                storage = (node.device, node.data_ptr(), node.dtype, tuple(node.shape), node.stride())
                if storage not in taken:
                    buffer = self._buffers.get(path)
                    if buffer is None or buffer.shape != node.shape or buffer.dtype != node.dtype:
                        buffer = self._buffers[path] = torch.empty(node.shape, dtype=node.dtype, pin_memory=node.is_cuda)
                    if node.data_ptr() in later:
                        pending.append((buffer, node.detach()))
                    else:
                        buffer.copy_(node.detach(), non_blocking=node.is_cuda)
                    taken[storage] = buffer
                return taken[storage]
            if type(node) in (dict, OrderedDict):  # OrderedDict: Accelerate's save() dedups model states by it
                return type(node)((key, copied(value, (*path, key))) for key, value in node.items())
            if type(node) in (list, tuple):
                return type(node)(copied(value, (*path, i)) for i, value in enumerate(node))
            return copy.deepcopy(node)

        snapshot = copied(tree, ())
        ready = None
        if any(buffer.is_pinned() for buffer in taken.values()):
            ready = torch.cuda.Event()
            ready.record()
        return snapshot, pending, ready

    @staticmethod
    def copy_later(pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for buffer, source in pending:
            buffer.copy_(source)


class CheckpointWriter:
    """Saves checkpoints, finishing each in the background so that training goes on meanwhile.

    save() blocks only for what must match its step: Accelerate's small files (RNG states,
    samplers, grad scaler) on every process, and a snapshot of the models' and optimizers' tensors
    (StateSnapshot). On the CPU the parameters and optimizer moments, which only an optimizer step
    changes, are copied by the writer thread during the next step's forward and backward, and the
    optimizers wait for that copy before stepping. The main process's thread then writes what
    save_state would write of the models, optimizers and schedulers, from the snapshot, then
    model.safetensors, the JSON files and the manifest (a sha256 of every file), and renames the
    directory into place. The training thread reports the checkpoint at the next report_finished()
    once it is complete (reporters write from one thread only), or at finish(). Only one is ever in
    flight: save() and finish() wait for the previous one first, so the loop never starts a second
    save, nor exits, while one is being written. A crash meanwhile leaves only the `.tmp-` staging
    directory, never reported.
    Setups whose state Accelerate saves its own way (its FSDP plugin, DeepSpeed, save hooks) get a
    plain save_state, as does a host without the memory for the snapshot. A model sharded by the
    `fsdp` strategy (`sharded`) has its model and optimizer state written by every process in the
    background (ShardedState), the rest as above; model.safetensors is gathered whole at save().
    """

    def __init__(
        self, accelerator: Accelerator, run_dir: Path, spec: JobSpec, reporter: Reporter,
        tokenizer: Tokenizer | None = None, labels: list[str] | None = None, sharded: ShardedState | None = None,
    ):
        self.accelerator, self.run_dir, self.spec, self.reporter = accelerator, run_dir, spec, reporter
        self.tokenizer, self.labels, self._sharded = tokenizer, labels, sharded
        self._pending: tuple[int, Path, threading.Thread] | None = None
        self._error: BaseException | None = None
        self._snapshot: StateSnapshot | None = StateSnapshot() if sharded is None and snapshots_supported(accelerator) else None
        # Set while no snapshot copy is pending; an optimizer step waits for it (see _take_snapshot).
        self._copied = threading.Event()
        self._copied.set()
        self._hooked: set[int] = set()

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
        models = model if isinstance(model, dict) else {"": model}
        state, pending, ready = self._take_state(staging / "state", models)
        accelerator.wait_for_everyone()  # every process's files are written before the main process hashes them
        if not accelerator.is_main_process:
            if accelerator.is_local_main_process:
                # Another node of a multi-node job (its own run dir): only node 0's copy is kept (the
                # RNG states written here are not needed to resume, the loop reseeds per step).
                shutil.rmtree(staging, ignore_errors=True)
            return None
        texts = {"trainer_state.json": json.dumps(trainer_state), "spec.json": self.spec.model_dump_json()}
        for each in models.values():  # e.g. an `hf` model's config.json: the checkpoint is a transformers model directory
            texts.update(getattr(accelerator.unwrap_model(each), "checkpoint_files", dict)())
        if self.tokenizer is not None:
            texts["tokenizer.json"] = json.dumps(self.tokenizer.to_json())
        if self.labels is not None:  # a classifier's label names, by label id
            texts["labels.json"] = json.dumps(self.labels)
        if pending:
            self._copied.clear()
        shards = self._sharded.pending if self._sharded is not None else None
        thread = threading.Thread(target=self._write, args=(staging, final, step, state, pending, ready, shards, texts), daemon=True)
        self._pending = (step, final, thread)
        thread.start()
        return final

    def _take_state(self, state_dir: Path, models: dict[str, torch.nn.Module]) -> tuple[dict, list, torch.cuda.Event | None]:
        """On every process: what save_state writes at once, or only its small files and a snapshot
        of the rest. Returns on the main process what _write writes: Accelerate's model, optimizer
        and scheduler states (none when save_state wrote them) and the unwrapped weights, with the
        copies left to do (StateSnapshot.take)."""
        accelerator = self.accelerator
        if self._sharded is not None:
            return self._take_sharded_state(state_dir, models[""])
        unwrapped = {
            f"{prefix}.{name}" if prefix else name: tensor
            for prefix, each in models.items()
            for name, tensor in accelerator.unwrap_model(each, keep_torch_compile=False).state_dict().items()
        } if accelerator.is_main_process else {}
        if self._snapshot is not None:
            try:
                return self._take_snapshot(state_dir, unwrapped)
            except (RuntimeError, MemoryError):  # no room for the buffers (pinned memory is scarce)
                log.warning("no memory for a checkpoint snapshot; saving synchronously from now on", exc_info=True)
                self._snapshot = None
        accelerator.save_state(str(state_dir))
        # The live weights, copied: training changes them in place from the next step on.
        return {"weights": {name: tensor.detach().to("cpu", copy=True) for name, tensor in unwrapped.items()}}, [], None

    def _save_small_files(self, state_dir: Path) -> None:
        """Accelerate's files besides the models, optimizers and schedulers, as save_state writes
        them, now: the RNG states must be this step's."""
        accelerator = self.accelerator
        config = accelerator.project_configuration
        state_dir.mkdir(parents=True, exist_ok=True)
        save_accelerator_state(
            str(state_dir), [], [], [], accelerator._dataloaders, accelerator.state.process_index, accelerator.step,
            accelerator.scaler, save_on_each_node=config.save_on_each_node,
        )
        for i, custom in enumerate(accelerator._custom_objects):
            save_custom_state(custom, str(state_dir), i, save_on_each_node=config.save_on_each_node)

    def _take_sharded_state(self, state_dir: Path, model: torch.nn.Module) -> tuple[dict, list, None]:
        """The sharded strategy's state: its shards saved in the background on every process; on
        the main process the full weights (gathered here, from every process) and the schedule."""
        accelerator = self.accelerator
        weights = full_weights(model)
        self._save_small_files(state_dir)
        self._sharded.save(model, accelerator._optimizers[0].optimizer, state_dir)
        if not accelerator.is_main_process:
            return {}, [], None
        return {"schedulers": [copy.deepcopy(each.state_dict()) for each in accelerator._schedulers], "weights": weights}, [], None

    def _take_snapshot(self, state_dir: Path, unwrapped: dict[str, torch.Tensor]) -> tuple[dict, list, torch.cuda.Event | None]:
        accelerator = self.accelerator
        self._save_small_files(state_dir)
        if not accelerator.is_main_process:  # Accelerate writes the rest from the main process only
            return {}, [], None
        # What only an optimizer step changes (its parameters and their moments) on the CPU is
        # copied by the writer thread, beside the next step's forward and backward; each optimizer
        # waits for that copy before its next step. The rest (buffers such as running statistics,
        # which a forward changes; the optimizers' settings) is copied now. GPU copies are
        # asynchronous anyway, queued before the next step's kernels.
        for optimizer in accelerator._optimizers:
            if id(optimizer) not in self._hooked:
                optimizer.optimizer.register_step_pre_hook(self._wait_for_copy)
                self._hooked.add(id(optimizer))
        stepped = [
            tensor
            for optimizer in accelerator._optimizers
            for tensors in ([p for group in optimizer.param_groups for p in group["params"]], *optimizer.state.values())
            for tensor in (tensors.values() if isinstance(tensors, dict) else tensors)
        ]
        later = {tensor.data_ptr() for tensor in stepped if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"}
        return self._snapshot.take({
            "models": [accelerator.get_state_dict(each, unwrap=False) for each in accelerator._models],
            "optimizers": [optimizer.state_dict() for optimizer in accelerator._optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in accelerator._schedulers],
            "weights": unwrapped,
        }, later)

    def _wait_for_copy(self, *_) -> None:
        self._copied.wait()

    def _write(
        self, staging: Path, final: Path, step: int, state: dict, pending: list, ready: torch.cuda.Event | None,
        shards: Future | None, texts: dict[str, str],
    ) -> None:
        try:
            try:
                StateSnapshot.copy_later(pending)
            finally:
                self._copied.set()  # the optimizers may step again
            if ready is not None:
                ready.synchronize()  # the snapshot's GPU → CPU copies are done
            if shards is not None:
                shards.result()  # every process's shards are written (ShardedState)
            write_accelerate_state(staging / "state", state)
            # Distinct tensors for tied weights (an `hf` model's), which safetensors refuses to save as two names of one storage.
            seen: set[int] = set()
            weights = {}
            for name, tensor in state["weights"].items():
                weights[name] = tensor.clone() if tensor.data_ptr() in seen else tensor.contiguous()
                seen.add(tensor.data_ptr())
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
            prune_checkpoints(self.run_dir, self.spec.checkpoint)

    def finish(self) -> None:
        """Wait for the checkpoint in flight, if any, and report it (every process waits for its shards)."""
        if self._pending is not None:
            self._pending[2].join()
            self.report_finished()
        if self._sharded is not None:
            self._sharded.wait()


def snapshots_supported(accelerator: Accelerator) -> bool:
    """Whether save_state's files can be written from a snapshot: plain and data-parallel models,
    no save hooks (FSDP, DeepSpeed and Megatron shard or save their state themselves)."""
    return (
        accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        and not accelerator._save_model_state_pre_hook
    )


def write_accelerate_state(state_dir: Path, state: dict) -> None:
    """The model, optimizer and scheduler files of accelerator.save_state, under its names (see
    accelerate.checkpointing.save_accelerator_state), from a snapshot of their state dicts."""
    for i, weights in enumerate(state.get("models", [])):
        save(weights, state_dir / (SAFE_WEIGHTS_NAME if i == 0 else SAFE_WEIGHTS_NAME.replace(".", f"_{i}.")), safe_serialization=True)
    for key, name in (("optimizers", OPTIMIZER_NAME), ("schedulers", SCHEDULER_NAME)):
        for i, each in enumerate(state.get(key, [])):
            save(each, state_dir / (f"{name}.bin" if i == 0 else f"{name}_{i}.bin"))


def prune_checkpoints(run_dir: Path, policy: CheckpointConfig) -> None:
    """Keep the newest `keep_last` local checkpoints, and with `keep_best` the one of the best
    `best_metric` (run outside a worker, nobody else cleans up; a worker's service does the same)."""
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    stale = saved[:-policy.keep_last]
    if policy.keep_best:
        values = {path: load_trainer_state(path).get(policy.best_metric) for path in saved}
        best = None
        for path, value in values.items():
            if value is not None and math.isfinite(value) and policy.better(value, values.get(best)):
                best = path
        stale = [path for path in stale if path != best]
    for old in stale:
        shutil.rmtree(old, ignore_errors=True)


def load_state(
    accelerator: Accelerator, state_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: ShardedState | None
) -> None:
    """Resume from a checkpoint's state/: accelerator.load_state(), or for a sharded model its
    model and optimizer from their shards (on any number of processes) and the rest as load_state reads it."""
    if sharded is None:
        accelerator.load_state(str(state_dir))
        return
    sharded.load(model, optimizer.optimizer, state_dir)
    load_accelerator_state(
        str(state_dir), [], [], accelerator._schedulers, accelerator._dataloaders, accelerator.process_index, accelerator.scaler
    )


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
    raw = json.loads((checkpoint / "spec.json").read_text())
    if raw.get("model", {}).get("kind") == "gpt":
        # Written before model.tie_embeddings existed, when every gpt's head was tied (migration 0020).
        raw["model"].setdefault("tie_embeddings", True)
    spec = JobSpec.from_stored(raw)
    tokenizer = Tokenizer.from_json(json.loads((checkpoint / "tokenizer.json").read_text()))
    return load_model(spec, tokenizer.vocab_size, checkpoint / MODEL_FILE, data_root), tokenizer, spec
