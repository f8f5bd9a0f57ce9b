"""The training job spec: one typed config per concern, validated field by field.

The same classes are used by the API (to reject bad input with 422), the scheduler
(to read resources) and the worker (to build the training run), so a spec that passes
here is one the worker can run.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Config(BaseModel):
    # A misspelt field is a user error, not something to ignore silently.
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Config):
    """A nanoGPT-style causal language model."""

    kind: Literal["gpt"] = Field(description="`gpt`: a causal LM on a `text` dataset; `mlp`: a classifier (MLPConfig).")
    n_layer: int = Field(4, ge=1, le=96, description="Number of transformer blocks.")
    n_head: int = Field(4, ge=1, le=128, description="Attention heads per block.")
    n_embd: int = Field(128, ge=8, le=16384, description="Embedding width; must be divisible by n_head.")
    block_size: int = Field(64, ge=2, le=32768, description="Context length in tokens.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability during training.")
    bias: bool = Field(False, description="Use bias in Linear and LayerNorm layers.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class MLPConfig(_Config):
    """A text classifier: mean of character (or byte) embeddings, then an MLP to `num_labels` logits."""

    kind: Literal["mlp"] = Field(description="Model family: a classifier for a `jsonl` or `csv` dataset.")
    num_labels: int = Field(ge=2, le=10_000, description="Distinct labels; the dataset must hold exactly this many.")
    max_length: int = Field(128, ge=1, le=65536, description="Characters (or bytes) of each text used; longer ones are cut.")
    n_embd: int = Field(64, ge=4, le=16384, description="Embedding width.")
    hidden: int = Field(128, ge=4, le=65536, description="Width of each hidden layer.")
    n_layer: int = Field(2, ge=1, le=32, description="Hidden layers.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability during training.")


class _DatasetPath(_Config):
    path: str = Field(min_length=1, max_length=1024, description="File path relative to the service's data root.")
    tokenizer: Literal["char", "byte"] = Field("char", description="`char`: vocabulary of the data's characters; `byte`: 256 byte values.")
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5, description="Tail fraction held out for evaluation.")

    @field_validator("path")
    @classmethod
    def _relative_inside_root(cls, path: str) -> str:
        # The full check (resolves inside the data root, exists) needs the server's data
        # root; this one rejects what can never be right wherever the root is.
        p = PurePosixPath(path)
        if p.is_absolute() or "\\" in path:
            raise ValueError("must be a relative path under the data root")
        if ".." in p.parts:
            raise ValueError("must not contain '..'")
        return path


class DatasetConfig(_DatasetPath):
    """A plain-text corpus, tokenised per character or per byte."""

    kind: Literal["text"] = Field(description="`text`: one corpus for a language model; `jsonl`/`csv`: labelled texts (LabelledDatasetConfig).")


class LabelledDatasetConfig(_DatasetPath):
    """Labelled texts for a classifier: JSON lines or a CSV file with a header row."""

    kind: Literal["jsonl", "csv"] = Field(description="File format.")
    text_column: str = Field("text", min_length=1, max_length=200, description="Field holding each text.")
    label_column: str = Field("label", min_length=1, max_length=200, description="Field holding each label (any strings or numbers).")


class TrainingConfig(_Config):
    """How the loop runs. A step is one optimizer step."""

    max_steps: int = Field(ge=1, le=10_000_000, description="Optimizer steps to train for.")
    micro_batch_size: int = Field(ge=1, le=65536, description="Samples per process per forward pass.")
    gradient_accumulation_steps: int = Field(1, ge=1, le=4096, description="Micro-batches accumulated per optimizer step.")
    precision: Literal["no", "fp16", "bf16"] = Field("no", description="Accelerate mixed precision mode.")
    grad_clip_norm: float | None = Field(None, gt=0.0, description="Clip the global gradient norm to this value; null disables.")
    grad_clip_value: float | None = Field(None, gt=0.0, description="Clamp each gradient element to ±this value; null disables.")
    compile: bool = Field(False, description="Wrap the model with torch.compile.")
    seed: int = Field(1337, ge=0, le=2**32 - 1, description="Seed for weights, data order and dropout.")
    eval_every: int = Field(250, ge=1, description="Evaluate every this many steps (and always at the last step).")
    eval_batches: int = Field(20, ge=1, le=100_000, description="Validation batches per evaluation (per process).")
    stall_timeout_s: float | None = Field(
        None,
        gt=0.0,
        description=(
            "Fail the attempt (retried under max_restarts, from the latest checkpoint) when no optimizer step "
            "completes for this many seconds, counted from the attempt's start for the first step; it must cover "
            "start-up, an evaluation and a checkpoint save. null disables."
        ),
    )


class OptimizerConfig(_Config):
    name: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(gt=0.0, le=10.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=10.0, description="Decoupled weight decay (AdamW) or L2 (SGD).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas


class ScheduleConfig(_Config):
    """Learning-rate schedule, defined per optimizer step."""

    name: Literal["constant", "linear", "cosine"] = Field("cosine", description="Schedule shape after warmup.")
    warmup_steps: int | None = Field(None, ge=0, description="Linear warmup steps; null means 10% of max_steps.")
    min_lr: float = Field(0.0, ge=0.0, description="Final learning rate for `cosine` and `linear`.")


class ResourcesConfig(_Config):
    nodes: int = Field(1, ge=1, le=1024, description="Hosts the job runs on.")
    processes_per_node: int = Field(1, ge=1, le=64, description="Training processes (devices) per host.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Device kind each process uses.")
    min_gpu_memory_gb: float | None = Field(None, gt=0, description="Only GPUs with at least this much memory (cuda only).")

    @model_validator(mode="after")
    def _gpu_memory_needs_cuda(self) -> ResourcesConfig:
        if self.min_gpu_memory_gb is not None and self.device != "cuda":
            raise ValueError("resources.min_gpu_memory_gb needs device 'cuda'")
        return self


class CheckpointConfig(_Config):
    every_steps: int | None = Field(None, ge=1, description="Save every this many steps; the last step is always saved.")
    keep_last: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept per job; older ones are deleted.")


class JobSpec(_Config):
    """Everything needed to run a training job, as POSTed to /v1/jobs."""

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Human-readable job name.")
    model: Annotated[ModelConfig | MLPConfig, Field(discriminator="kind")]
    dataset: Annotated[DatasetConfig | LabelledDatasetConfig, Field(discriminator="kind")]
    training: TrainingConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig = Field(default_factory=lambda: ScheduleConfig())
    resources: ResourcesConfig = Field(default_factory=lambda: ResourcesConfig())
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CheckpointConfig())
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first.")
    max_restarts: int = Field(3, ge=0, le=100, description="Retries after a failed or lost attempt.")
    preemptible: bool = Field(
        False, description="May be stopped for a higher-priority job: it checkpoints, goes back to the queue and resumes from there."
    )

    @model_validator(mode="after")
    def _cross_field_rules(self) -> JobSpec:
        if (self.model.kind == "gpt") != (self.dataset.kind == "text"):
            raise ValueError("dataset.kind: a `gpt` model trains on a `text` dataset, an `mlp` classifier on `jsonl` or `csv`")
        if self.training.precision == "fp16" and self.resources.device == "cpu":
            raise ValueError("training.precision: fp16 needs device 'cuda' (use 'bf16' or 'no' on CPU)")
        if self.training.grad_clip_norm and self.training.grad_clip_value:
            raise ValueError("training: set grad_clip_norm or grad_clip_value, not both")
        if self.schedule.warmup_steps is not None and self.schedule.warmup_steps >= self.training.max_steps:
            raise ValueError("schedule.warmup_steps must be smaller than training.max_steps")
        if self.schedule.min_lr > self.optimizer.lr:
            raise ValueError("schedule.min_lr must not exceed optimizer.lr")
        return self

    @property
    def warmup_steps(self) -> int:
        if self.training.grad_clip_norm and self.training.grad_clip_value:
            raise ValueError("training: set grad_clip_norm or grad_clip_value, not both")
        if self.schedule.warmup_steps is not None:
            return self.schedule.warmup_steps
        return self.training.max_steps // 10

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.processes_per_node

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step across all processes."""
        return self.training.micro_batch_size * self.training.gradient_accumulation_steps * self.world_size


# `model` and `dataset` are unions told apart by `kind`; pydantic puts that tag into an error's
# location (`dataset.text.path`). People know the field as `dataset.path`.
_UNION_TAGS = {"model": {"gpt", "mlp"}, "dataset": {"text", "jsonl", "csv"}}


def field_location(loc: tuple | list) -> tuple:
    """An error location as the user wrote the field: without the union's tag."""
    return tuple(part for i, part in enumerate(loc) if not (i and part in _UNION_TAGS.get(loc[i - 1], ())))
