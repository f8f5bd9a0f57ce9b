"""Shared pieces of the training-engine tests: a collecting reporter, one-call runs, and a
plain-PyTorch reference loop that the engine's results are compared against."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.state import AcceleratorState, GradientState, PartialState
from safetensors.torch import load_file

from api_schemas import JobSpec
from api_schemas.manifest import MODEL_FILE
from workers.launch import launch_command
from workers.supervisor import free_port
from workers.training import GPT, TokenWindows, load_text_corpus, lr_at, train

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "tinyshakespeare.txt"


def samples_per_step(spec: JobSpec) -> int:
    return spec.training.micro_batch_size * spec.training.gradient_accumulation_steps * spec.world_size


def micro_batches_per_epoch(spec: JobSpec, data_root: Path) -> int:
    """On one process: an epoch holds whole optimizer steps, so whole accumulation windows."""
    corpus = load_text_corpus(spec.dataset, data_root)
    return len(TokenWindows(corpus.train, spec.model.block_size, multiple_of=samples_per_step(spec))) // spec.training.micro_batch_size


@dataclass
class Collector:
    """A Reporter that keeps everything it is told, in order."""

    takes_checkpoints = False

    metrics_log: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    checkpoints: dict[int, Path] = field(default_factory=dict)
    spikes: list[tuple[int, int, str]] = field(default_factory=list)
    closed: bool = False

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.metrics_log.append((step, dict(values)))

    def checkpoint(self, step: int, path: Path) -> None:
        self.checkpoints[step] = Path(path)

    def spike(self, first_step: int, last_step: int, reason: str) -> None:
        self.spikes.append((first_step, last_step, reason))

    def close(self) -> None:
        self.closed = True

    @property
    def steps(self) -> dict[int, dict[str, float]]:
        return dict(self.metrics_log)

    def series(self, name: str) -> list[float]:
        return [values[name] for _, values in self.metrics_log if name in values]

    def final_weights(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.checkpoints[max(self.checkpoints)] / MODEL_FILE))


def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; each in-process run must start from none."""
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    GradientState._reset_state()


def run_training(spec: dict | JobSpec, data_root: Path, run_dir: Path, resume_from: Path | None = None, skip_steps: int = 0) -> Collector:
    """One in-process train() call, as `python -m workers.training` would make it."""
    spec = spec if isinstance(spec, JobSpec) else JobSpec.model_validate(spec)
    collector = Collector()
    previous = signal.getsignal(signal.SIGTERM)
    reset_accelerate()
    try:
        train(spec, data_root, run_dir, collector, resume_from, skip_steps)
    finally:
        reset_accelerate()
        signal.signal(signal.SIGTERM, previous)  # train() installs its own handler
    # One metrics event per step, in order, each step once.
    assert [s for s, _ in collector.metrics_log] == sorted({s for s, _ in collector.metrics_log})
    return collector


def write_corpus(data_root: Path, chars: int | None = None, name: str = "corpus.txt") -> str:
    """The first `chars` characters of Tiny Shakespeare (all of it for None) under data_root."""
    data_root.mkdir(parents=True, exist_ok=True)
    text = CORPUS.read_text(encoding="utf-8")
    (data_root / name).write_text(text if chars is None else text[:chars], encoding="utf-8")
    return name


def subprocess_env(events: Path | None = None, threads: int = 1) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    env.pop("TRAINYARD_EVENTS_FILE", None)
    if events is not None:
        env["TRAINYARD_EVENTS_FILE"] = str(events)
    return env


def entry_point(spec_file: Path, data_root: Path, run_dir: Path, resume_from: Path | None = None) -> list[str]:
    command = [sys.executable, "-m", "workers.training", "--spec", str(spec_file), "--data-root", str(data_root), "--run-dir", str(run_dir)]
    return command + (["--resume-from", str(resume_from)] if resume_from else [])


def read_events(path: Path) -> list[dict]:
    """The events written so far: complete lines only (a test reading while the training appends
    can catch the last line half written)."""
    if not path.exists():
        return []
    complete = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


# --- The reference: what the engine should compute, written as a plain PyTorch loop ---------------


@dataclass
class Reference:
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    train_loss: list[float]
    grad_norm: list[float]  # before clipping
    lr: list[float]


def reference_training(spec: JobSpec, data_root: Path, steps: int) -> Reference:
    """`steps` optimizer steps as the spec describes them, on one process, fp32, no dropout.

    Each step consumes the next `gradient_accumulation_steps` micro-batches of the epoch's sample
    order (windows in `TokenWindows` order for (seed, epoch), an epoch trimmed to whole steps);
    its gradient is the gradient of the mean loss over the micro-batches it consumed, clipped to
    `grad_clip_norm`, and the optimizer runs at lr_at(step)."""
    cfg = spec.training
    assert spec.model.dropout == 0.0 and cfg.precision == "no"
    torch.manual_seed(cfg.seed)
    corpus = load_text_corpus(spec.dataset, data_root)
    windows = TokenWindows(
        corpus.train, spec.model.block_size, seed=cfg.seed, multiple_of=samples_per_step(spec),
        random_offsets=spec.dataset.windows == "random",
    )
    model = GPT(spec.model, corpus.tokenizer.vocab_size).train()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}

    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.optimizer.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if spec.optimizer.name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=spec.optimizer.lr, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(groups, lr=spec.optimizer.lr, betas=spec.optimizer.betas)

    def micro_batches():
        epoch = 0
        while True:
            windows.set_epoch(epoch)
            per_epoch = len(windows) // cfg.micro_batch_size
            for b in range(per_epoch):
                samples = [windows[i] for i in range(b * cfg.micro_batch_size, (b + 1) * cfg.micro_batch_size)]
                yield torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples]), b == per_epoch - 1
            epoch += 1

    batches = micro_batches()
    losses, norms, lrs = [], [], []
    for step in range(steps):
        window = []
        for _ in range(cfg.gradient_accumulation_steps):
            inputs, targets, last_of_epoch = next(batches)
            window.append((inputs, targets))
            if last_of_epoch:
                break  # a window never spans two epochs
        total = 0.0
        for inputs, targets in window:
            _, loss = model(inputs, targets)
            (loss / len(window)).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip_norm or float("inf"))
        lr = lr_at(step, spec)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / len(window))
        norms.append(norm.item())
        lrs.append(lr)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Reference(initial, final, losses, norms, lrs)


def launch(
    spec: JobSpec, data_root: Path, run_dir: Path, events: Path, resume_from: Path | None = None, processes: int | None = None,
) -> subprocess.Popen:
    """The worker's own launch command for `spec` (gloo processes on the CPU), started; on
    `processes` processes if given, as an elastic job resumed on another count is (its spec unchanged)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(spec.model_dump_json())
    placed = spec if processes is None else spec.placed_on(processes)
    command = launch_command(placed, run_dir, data_root, resume_from, f"127.0.0.1:{free_port()}")
    # Its own session, so that a test can kill the launcher and its ranks together.
    return subprocess.Popen(
        command, cwd=REPO, env=subprocess_env(events), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def launched(spec: JobSpec, data_root: Path, run_dir: Path, resume_from: Path | None = None, processes: int | None = None) -> list[dict]:
    """launch() to the end; the events it wrote."""
    events = run_dir.parent / f"{run_dir.name}-events.jsonl"
    process = launch(spec, data_root, run_dir, events, resume_from, processes)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return read_events(events)


def metrics_of(events: list[dict]) -> dict[int, dict[str, float]]:
    return {e["step"]: e["values"] for e in events if e["type"] == "metrics"}


def checkpoints_of(events: list[dict]) -> dict[int, Path]:
    return {e["step"]: Path(e["path"]) for e in events if e["type"] == "checkpoint"}
