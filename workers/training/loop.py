"""The training loop: an Accelerate loop that reads top to bottom.

It knows nothing of the service: it reads a JobSpec, trains, and tells a Reporter about metrics
and checkpoints. Run it under a Trainyard worker or a plain `accelerate launch -m workers.training`.
"""

from __future__ import annotations

import math
import resource
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader

from api_schemas import JobSpec
from workers.training.checkpoint import CheckpointWriter, load_state, load_trainer_state
from workers.training.data import LabelledTexts, TokenWindows, load_labelled_corpus, load_text_corpus
from workers.training.elastic import accumulation_steps, batches_on, skipped
from workers.loss_guard import LossGuard, Spike
from workers.training.evaluate import eval_dataloader, evaluate_metrics
from workers.training.model import build_model
from workers.training.reporter import Reporter
from workers.training.schedule import make_scheduler, recount_scheduler
from workers.training.sharding import ShardedState, shard_model


@dataclass
class TrainResult:
    step: int
    preempted: bool
    last_eval_loss: float | None
    spike: Spike | None = None  # the loss guard stopped the run: roll back (guard.py)


def make_optimizer(model: torch.nn.Module, spec: JobSpec) -> torch.optim.Optimizer:
    # As nanoGPT: weight decay on every 2-D tensor (matrices, embeddings), none on biases and norms.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.optimizer.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = bool(spec.optimizer.fused)
    if spec.optimizer.name == "sgd":
        return torch.optim.SGD(groups, lr=spec.optimizer.lr, momentum=0.9, fused=fused)
    return torch.optim.AdamW(groups, lr=spec.optimizer.lr, betas=spec.optimizer.betas, fused=fused)


def make_accelerator(spec: JobSpec) -> Accelerator:
    """The Accelerator of one training process, as the spec asks. Batches are copied to a GPU
    without blocking (from pinned memory: see `pinned`): a blocking copy makes the CPU wait until
    the GPU has drained its queue, once per micro-batch, so the next kernels start late."""
    # TF32 is a process-wide switch: set here, where the built-in and custom loops both start.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = spec.training.tf32
    return Accelerator(
        gradient_accumulation_steps=spec.training.gradient_accumulation_steps,
        mixed_precision=spec.training.precision,
        cpu=spec.resources.device == "cpu",
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
    )


def pinned(accelerator: Accelerator) -> bool:
    """Whether training loaders pin their batches: on a GPU, where only a copy from pinned memory
    runs asynchronously (from ordinary memory the CPU first copies it into a staging buffer)."""
    return accelerator.device.type == "cuda"


def train(
    spec: JobSpec, data_root: Path, run_dir: Path, reporter: Reporter, resume_from: Path | None = None, skip_steps: int = 0
) -> TrainResult:
    cfg = spec.training
    accelerator = make_accelerator(spec)
    # The spec's optimizer step on however many processes run it (elastic.py).
    accelerator.gradient_accumulation_steps = accumulation_steps(spec, accelerator.num_processes)
    set_seed(cfg.seed)

    # Data: fixed samples (token windows, or labelled texts) whose order depends only on (seed,
    # epoch), so a resumed run and a run on more processes see exactly the same ones. Each epoch
    # holds whole optimizer steps: Accelerate ends an epoch's last accumulation window early, yet
    # still divides its loss by the full window length, which would shrink that step.
    samples_per_step = spec.effective_batch_size
    labels = None
    if spec.model.task == "lm":
        corpus = load_text_corpus(spec.dataset, data_root)
        train_set = TokenWindows(
            corpus.train, spec.model.block_size, seed=cfg.seed, multiple_of=samples_per_step,
            random_offsets=spec.dataset.windows == "random",
        )
        tokens_per_sample = spec.model.block_size
    else:
        corpus = load_labelled_corpus(spec.dataset, spec.model, data_root)
        shuffled = getattr(spec.dataset, "shuffle", True)
        train_set = LabelledTexts(corpus.train.ids, corpus.train.labels, seed=cfg.seed if shuffled else None, multiple_of=samples_per_step)
        tokens_per_sample, labels = spec.model.max_length, corpus.labels
    train_dl = DataLoader(train_set, batch_size=cfg.micro_batch_size, shuffle=False, drop_last=True, pin_memory=pinned(accelerator))
    # Evaluation: a sample spread over the validation split on schedule, the whole split at the end.
    eval_dl, final_eval_dl = eval_dataloader(corpus.val, spec), eval_dataloader(corpus.val, spec, whole=True)

    # Model, optimizer, schedule: built once, prepared once. A sharded model is sharded by torch
    # before the optimizer sees its parameters, and left out of Accelerate's prepare (sharding.py).
    model = build_model(spec.model, corpus.tokenizer.vocab_size, data_root)
    sharded = cfg.strategy == "fsdp"
    if sharded:
        model = shard_model(model, spec, accelerator.device)
    optimizer = make_optimizer(model, spec)
    scheduler = make_scheduler(optimizer, spec, accelerator.num_processes)
    if sharded:
        optimizer, train_dl, eval_dl, final_eval_dl, scheduler = accelerator.prepare(optimizer, train_dl, eval_dl, final_eval_dl, scheduler)
    else:
        model, optimizer, train_dl, eval_dl, final_eval_dl, scheduler = accelerator.prepare(
            model, optimizer, train_dl, eval_dl, final_eval_dl, scheduler
        )
    sharded_state = ShardedState(accelerator.device) if sharded else None

    # Resume: weights, optimizer, schedule and RNG from the Accelerate state (and the sharded state);
    # where the loop was from the explicit trainer state, in this run's count of processes.
    # Loaded before compiling, so no weights go into a compiled module.
    progress = {"step": 0, "epoch": 0, "batch_in_epoch": 0}
    recent_losses = []  # the loss guard's window at the checkpoint: a resumed run is guarded from its first step
    best_value = None  # the best checkpoint.best_metric so far: with checkpoint.keep_best, an evaluation that beats it is saved
    if resume_from is not None:
        load_state(accelerator, resume_from / "state", model, optimizer, sharded_state)
        progress = load_trainer_state(resume_from)
        recent_losses = progress.pop("recent_losses", [])
        best_value = progress.pop("best_value", progress.pop("best_eval_loss", None))  # best_eval_loss: a checkpoint from before best_metric
        for name in spec.evaluated_metrics():  # the step's evaluation, not where the loop was
            progress.pop(name, None)
        progress["batch_in_epoch"] = batches_on(progress, accelerator.num_processes, spec)
        recount_scheduler(scheduler, progress["step"], accelerator.num_processes)
        accelerator.print(f"resumed from {resume_from} at step {progress['step']}")
    # After a rollback: past the data of the steps the loss guard threw away (guard.py).
    if skip_steps:
        progress = skipped(progress, skip_steps, accelerator.gradient_accumulation_steps, len(train_dl))
        accelerator.print(f"skipping the batches of {skip_steps} steps after step {progress['step']} (a rolled-back spike)")
    # Compiled, training calls the loss alone (training_loss) and evaluation the model; a sharded
    # model's blocks were compiled when sharded.
    compiled = cfg.compile and not sharded
    forward = torch.compile(model) if compiled else model
    loss_of = torch.compile(training_loss(model)) if compiled else training_loss(model)

    step, epoch, batch_in_epoch = progress["step"], progress["epoch"], progress["batch_in_epoch"]
    tokens_per_micro_batch = cfg.micro_batch_size * tokens_per_sample * accelerator.num_processes
    last_eval = None
    evaluation: dict[str, float] = {}  # the last evaluation's metrics
    preempted = False
    lagged = LaggedMetrics(accelerator.device)
    checkpoints = CheckpointWriter(accelerator, run_dir, spec, reporter, corpus.tokenizer, labels, sharded_state)
    guard, spike = LossGuard(cfg.guard, recent=recent_losses), None

    def report(read: tuple[int, dict[str, float]] | None) -> bool:
        """Report a step's metrics from the main process and show them to the loss guard (every
        process sees the same numbers, so all find a spike alike); True if any process voted to stop."""
        nonlocal spike
        if read is None:
            return False
        read_step, metrics = read
        stop = metrics.pop("stop_votes") > 0
        if accelerator.is_main_process:
            reporter.metrics(read_step, metrics)
        spike = spike or guard.observe(read_step, metrics["train_loss"], metrics.get("grad_norm"))
        return stop

    # Preemption: SIGTERM asks for a checkpoint at the next step boundary, then exit.
    with sigterm_requests() as stop_requested:
        model.train()
        # Step time is wall time between optimizer steps (nanoGPT's dt): reporting, evaluation and
        # checkpointing are paid for by the step after them, never hidden.
        last_step_end = time.perf_counter()
        while step < cfg.max_steps and not preempted and spike is None:
            loader = accelerator.skip_first_batches(train_dl, batch_in_epoch) if batch_in_epoch else train_dl
            # Through the prepared loader, not the dataset: it re-applies its own epoch count to the
            # dataset whenever it starts iterating, and a resumed run's loaders have counted less.
            loader.set_epoch(epoch)
            window_loss, window_batches = torch.zeros((), device=accelerator.device), 0
            for inputs, targets in loader:
                batch_in_epoch += 1
                if window_batches == 0:
                    # Dropout draws from a seed of (seed, step), not from whatever the global RNG went
                    # through before: a resumed run builds a new dataloader iterator (which draws from
                    # the global RNG) where a straight run did not, and must still see the same masks.
                    torch.manual_seed(cfg.seed * 1_000_003 + step)

                # Forward and backward; Accelerate scales the loss for accumulation and skips the
                # gradient all-reduce until the last micro-batch of the window.
                with accelerator.accumulate(model):
                    loss = loss_of(inputs, targets)
                    accelerator.backward(loss)
                    window_loss += loss.detach()
                    window_batches += 1
                    if accelerator.sync_gradients:
                        lr = optimizer.param_groups[0]["lr"]
                        # The norm before clipping; an infinite limit measures without clipping.
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm or float("inf"))
                        if sharded:  # a DTensor over the shards; the reported norm is the whole one
                            grad_norm = grad_norm.full_tensor()
                        if cfg.grad_clip_value:
                            accelerator.clip_grad_value_(model.parameters(), cfg.grad_clip_value)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                if not accelerator.sync_gradients:
                    continue

                # One optimizer step done. Its scalars stay on the device until the next step is queued
                # (see LaggedMetrics); the previous step's are reported now.
                step += 1
                now = time.perf_counter()
                step_time, last_step_end = now - last_step_end, now
                last_step = step >= cfg.max_steps
                values = {
                    "lr": lr,
                    "step_time_s": step_time,
                    "tokens_per_s": window_batches * tokens_per_micro_batch / step_time,
                    "peak_memory_mb": _peak_memory_mb(accelerator.device),
                }
                evaluated = step % cfg.eval_every == 0 or last_step
                if evaluated:
                    evaluation = evaluate_metrics(forward, final_eval_dl if last_step else eval_dl, accelerator)
                    values.update(evaluation)
                    last_eval = evaluation["eval_loss"]
                # Every process evaluated the same gathered samples, so all decide alike.
                ranked = evaluation.get(spec.checkpoint.best_metric, math.nan)
                best = evaluated and spec.checkpoint.keep_best and math.isfinite(ranked) and spec.checkpoint.better(ranked, best_value)
                if best:
                    best_value = ranked
                previous = lagged.take()
                lagged.put(
                    step,
                    {
                        "train_loss": accelerator.reduce(window_loss / window_batches, reduction="mean"),
                        "grad_norm": grad_norm,
                        "stop_votes": stop_votes(accelerator, bool(stop_requested)),
                    },
                    values,
                )
                # SIGTERM on any process, seen one step late by all of them alike: stop here. A spike
                # (seen as late) stops the run at once, with no checkpoint of its suspect state.
                preempted = report(previous) and not last_step
                checkpoints.report_finished()  # a checkpoint written meanwhile in the background
                if spike is not None:
                    break

                # Checkpoint on schedule, at the end, when asked to stop and at a best evaluation (keep_best);
                # this step's metrics first. The loop waits only for the state of this step to be taken; the
                # files are finished in the background (CheckpointWriter), and a save waits for the previous one.
                if last_step or preempted or best or (spec.checkpoint.every_steps and step % spec.checkpoint.every_steps == 0):
                    report(lagged.take())
                    if spike is None:
                        checkpoints.save(model, {
                            "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "processes": accelerator.num_processes,
                            "recent_losses": list(guard.recent),
                            **(evaluation if evaluated else {}),  # the step's own: eval_loss, eval_accuracy (a classifier)
                            **({"best_value": best_value} if spec.checkpoint.keep_best else {}),
                        })
                if last_step or preempted or spike is not None:
                    break
                window_loss, window_batches = torch.zeros((), device=accelerator.device), 0
            else:
                epoch, batch_in_epoch = epoch + 1, 0

        report(lagged.take())
        checkpoints.finish()  # the last checkpoint is complete and reported before the process exits
        if spike is not None and accelerator.is_local_main_process:  # every node's worker must know: each rolls back its part
            reporter.spike(spike.first_step, spike.last_step, spike.reason)
        if sharded_state is not None:
            sharded_state.close()
    accelerator.end_training()
    return TrainResult(step=step, preempted=preempted, last_eval_loss=last_eval, spike=spike)


def training_loss(model: torch.nn.Module):
    """`model(inputs, targets)`'s loss alone, as a function to compile. Compiled whole, the logits
    the loop never reads are dead code and never written: Accelerate's mixed-precision wrapper
    converts a model's outputs to float32, which for GPT-2 small's 50k vocabulary at batch 16 is
    3.3 GB written per micro-batch. On an H200 that was 4.7% more tokens/s and 14.9 → 8.6 GB peak
    memory (bench/README.md, GPU section)."""

    def loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model(inputs, targets)[1]

    return loss


@contextmanager
def sigterm_requests() -> Iterator[list]:
    """A list that SIGTERM appends to while inside; the previous handler is restored after."""
    requested: list = []
    previous = signal.signal(signal.SIGTERM, lambda *_: requested.append(True))
    try:
        yield requested
    finally:
        signal.signal(signal.SIGTERM, previous)


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: allocated tensors on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def stop_votes(accelerator: Accelerator, stop: bool) -> torch.Tensor:
    """How many processes were asked to stop; checkpointing is collective, so all must agree."""
    # Filled on the device: torch.tensor(..., device=cuda) copies from the CPU and waits for the GPU.
    votes = torch.full((), float(stop), device=accelerator.device)
    return accelerator.reduce(votes, reduction="sum") if accelerator.num_processes > 1 else votes


class LaggedMetrics:
    """Holds one step's scalar metrics on the device and reads them back after the next step is queued.

    `.item()` on a GPU tensor makes the CPU wait until the GPU has drained its queue, so the next
    step's kernels start late: on an H100 that per-step stall cost 4% of throughput. Instead the
    scalars are copied to the host asynchronously, and read one step later behind a CUDA event.
    On the CPU this changes nothing but the order of two calls.
    """

    def __init__(self, device: torch.device):
        self.use_events = device.type == "cuda"
        self.pending: tuple | None = None

    def put(self, step: int, tensors: dict[str, torch.Tensor], values: dict[str, float]) -> None:
        names = list(tensors)
        stacked = torch.stack([tensors[name].detach().float().reshape(()) for name in names])
        host = stacked.to("cpu", non_blocking=True)
        event = None
        if self.use_events:
            event = torch.cuda.Event()
            event.record()
        self.pending = (step, names, host, event, values)

    def take(self) -> tuple[int, dict[str, float]] | None:
        if self.pending is None:
            return None
        step, names, host, event, values = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        return step, {**dict(zip(names, host.tolist())), **values}
