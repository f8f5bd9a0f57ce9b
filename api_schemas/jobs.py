"""The training job spec: one typed config per concern, validated field by field.

The same classes are used by the API (to reject bad input with 422), the scheduler
(to read resources) and the worker (to build the training run), so a spec that passes
here is one the worker can run.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Annotated, Any, ClassVar, Literal, Self, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer, model_validator


class SpecModel(BaseModel):
    # A misspelt field is a user error, not something to ignore silently; a NaN or infinite number
    # (`"lr": "NaN"`) is one too, refused as such rather than by a bound it happens to fail.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _plain_values(cls, data: Any, info: ValidationInfo) -> Any:
        """Refuse what Pydantic's lax mode lets through but nothing downstream can take: `true` for
        a number (read as 1), and a NUL character in a string, which no path, argument or
        environment variable can hold (the worker's launch failed on it, and the job with it).
        (Strict mode would also refuse an enum's value given as a string, so it is this check.)
        A stored spec is not checked: one stored before the check must still read."""
        if isinstance(data, dict) and not stored(info):
            for name, field in cls.model_fields.items():
                value = data.get(field.alias or name)
                if isinstance(value, bool) and set(get_args(field.annotation) or [field.annotation]) & {int, float}:
                    raise ValueError(f"{name}: a number is needed, not {str(value).lower()}")
                mapping = isinstance(value, dict) and get_origin(field.annotation) is dict  # not a nested spec's: it checks its own
                strings = value if isinstance(value, list) else [*value, *value.values()] if mapping else [value]
                if any(isinstance(string, str) and "\0" in string for string in strings):
                    raise ValueError(f"{name}: must not contain a NUL character")
        return data

    @classmethod
    def from_stored(cls, data: dict) -> Self:
        """A spec (or a part of one) as the service stored it when it was submitted, perhaps by an
        earlier version: a field this version no longer has (removed, or renamed) is left out, not
        refused, so an upgrade leaves no job unreadable, unschedulable or unrunnable. A new spec is
        read with `model_validate`, which refuses a misspelt field."""
        return cls.model_validate(data, extra="ignore", context={"stored": True})


NAME_MAX = 255  # bytes of one file name, on Linux's file systems


def stored(info: ValidationInfo | None) -> bool:
    """Whether what is validated is a stored spec (SpecModel.from_stored), not a new one."""
    return bool(info and (info.context or {}).get("stored"))


def relative_inside_root(path: str, root: str = "the data root", info: ValidationInfo | None = None) -> str:
    """Refuse what can never be right wherever the root is. The full check (resolves inside the
    root, exists) needs the server's root. A stored spec (`info`'s context) is spared the checks
    added since specs were first stored, so that one stored before still reads."""
    p = PurePosixPath(path)
    if p.is_absolute() or "\\" in path:
        raise ValueError(f"must be a relative path under {root}")
    if ".." in p.parts:
        raise ValueError("must not contain '..'")
    if any(len(part.encode()) > NAME_MAX for part in p.parts) and not stored(info):
        raise ValueError(f"a file or directory name is at most {NAME_MAX} bytes")
    return path


class ModelConfig(SpecModel):
    """A nanoGPT-style causal language model."""

    kind: Literal["gpt"] = Field(
        description="`gpt`: a causal LM on a `text` dataset; `mlp`: a classifier (MLPConfig); `hf`: a transformers model (HFModelConfig); "
        "`custom`: your own loop (CustomConfig)."
    )
    n_layer: int = Field(4, ge=1, le=96, description="Number of transformer blocks.")
    n_head: int = Field(4, ge=1, le=128, description="Attention heads per block.")
    n_embd: int = Field(128, ge=8, le=16384, description="Embedding width; must be divisible by n_head.")
    block_size: int = Field(64, ge=2, le=32768, description="Context length in tokens.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability during training.")
    bias: bool = Field(
        True,
        description="Biases in the Linear and LayerNorm layers, and in the output head when it is untied. On by default: on the "
        "example they helped by 0.007 nats (bench/README.md, quality.py); nanoGPT's `bias=False` is a little faster on GPUs.",
    )
    tie_embeddings: bool = Field(
        False,
        description="One matrix as both the token embedding and the output head (GPT-2's weight tying). Off by default: on the "
        "example (128 wide, 65 characters) tying cost 0.025 nats of validation loss (bench/README.md, quality.py); it saves "
        "vocabulary × n_embd parameters, which counts for large vocabularies.",
    )
    init: Literal["gpt2", "pytorch"] | None = Field(
        None,
        description="Initial weights. `gpt2`: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer), biases 0; `pytorch`: "
        "each layer's own default (uniform ±1/sqrt(fan_in) for Linear layers, N(0, 1) for embeddings). null: `pytorch` for an "
        "untied head (0.019 nats better than `gpt2` on the example), `gpt2` for a tied one, whose N(0, 1) head would start "
        "far from uniform; the job's spec records what was chosen.",
    )

    task: ClassVar[str] = "lm"

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.init is None:
            self.init = "gpt2" if self.tie_embeddings else "pytorch"
        return self


class MLPConfig(SpecModel):
    """A text classifier: mean of character (or byte) embeddings, then an MLP to `num_labels` logits."""

    kind: Literal["mlp"] = Field(description="Model family: a classifier for a `jsonl` or `csv` dataset.")
    num_labels: int = Field(ge=2, le=10_000, description="Distinct labels; the dataset must hold exactly this many.")
    max_length: int = Field(128, ge=1, le=65536, description="Characters (or bytes) of each text used; longer ones are cut.")
    n_embd: int = Field(64, ge=4, le=16384, description="Embedding width.")
    hidden: int = Field(128, ge=4, le=65536, description="Width of each hidden layer.")
    n_layer: int = Field(2, ge=1, le=32, description="Hidden layers.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability during training.")

    task: ClassVar[str] = "classify"


# transformers architectures a job may name, by task. Any of them trains on the ids of the dataset's
# tokenizer (char, byte or tokenizer_file): the engine sets vocab_size (and the padding id and num_labels) itself.
# (Not RoBERTa: its position ids count from the padding id, which is one past the vocabulary here.)
HF_CLASSIFIERS = (
    "BertForSequenceClassification", "DistilBertForSequenceClassification", "GPT2ForSequenceClassification", "LlamaForSequenceClassification",
)
HF_CAUSAL_LMS = ("GPT2LMHeadModel", "LlamaForCausalLM", "GPTNeoXForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# Config keys the engine sets from the data; a spec names num_labels as model.num_labels.
HF_ENGINE_KEYS = ("vocab_size", "num_labels", "pad_token_id", "id2label", "label2id")


class HFModelConfig(SpecModel):
    """A Hugging Face `transformers` model, built from a config or from a local directory; never downloaded."""

    kind: Literal["hf"] = Field(description="Model family: a transformers model.")
    architecture: Literal[HF_CLASSIFIERS + HF_CAUSAL_LMS] = Field(
        description="transformers model class. A `…ForSequenceClassification` trains on labelled texts, a causal LM on a corpus."
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        max_length=200,
        description="Keyword arguments of the architecture's config class (e.g. DistilBertConfig: n_layers, dim, n_heads, "
        "hidden_dim); the class defaults fill the rest. With `path`: changes to its config.json.",
    )
    path: str | None = Field(
        None, min_length=1, max_length=1024,
        description="A directory under the data root holding config.json and optionally model.safetensors (weights as safetensors only).",
    )
    num_labels: int | None = Field(None, ge=2, le=10_000, description="Classifiers: distinct labels; the dataset must hold exactly this many.")
    max_length: int = Field(
        128, ge=2, le=32768, description="Classifiers: tokens of each text used (longer ones are cut). Causal LMs: context length in tokens."
    )

    @field_validator("config")
    @classmethod
    def _engine_sets_vocabulary(cls, config: dict[str, Any]) -> dict[str, Any]:
        if set_here := sorted(set(config) & set(HF_ENGINE_KEYS)):
            raise ValueError(f"{', '.join(set_here)}: set by the engine from the tokenizer and model.num_labels, not in model.config")
        return config

    @field_validator("path")
    @classmethod
    def _path_inside_root(cls, path: str | None, info: ValidationInfo) -> str | None:
        return None if path is None else relative_inside_root(path, info=info)

    @model_validator(mode="after")
    def _labels_for_classifiers(self) -> HFModelConfig:
        if self.task == "classify" and self.num_labels is None:
            raise ValueError(f"num_labels: {self.architecture} is a classifier and needs num_labels")
        if self.task == "lm" and self.num_labels is not None:
            raise ValueError(f"num_labels: {self.architecture} is a language model, it has no labels")
        return self

    @property
    def task(self) -> str:
        return "classify" if self.architecture in HF_CLASSIFIERS else "lm"

    @property
    def block_size(self) -> int:
        """Context length of a causal LM (the same field as a classifier's text length)."""
        return self.max_length


class CustomConfig(SpecModel):
    """Your own training function, for loops the built-in one can't express (a GAN's two models and
    two optimizers, say). It is called with a prepared context: the accelerator, the job's dataset if
    it names one, `log_metric`, `save_checkpoint`, `resume_from` and `should_stop` (see
    workers/training/custom.py and examples/plugins/gan_example.py)."""

    kind: Literal["custom"] = Field(description="Model family: a function from the worker's plugin directory runs the job.")
    entrypoint: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*:[A-Za-z_][A-Za-z0-9_]*$",
        max_length=200,
        description="`module:function`: module.py in the plugin directory (TRAINYARD_PLUGIN_DIR, installed by the operator); "
        "one name, no dots or paths, so nothing outside that directory can be loaded.",
    )
    config: dict[str, Any] = Field(default_factory=dict, description="Free-form JSON handed to the function as `context.config`.")

    task: ClassVar[str] = "custom"


# Uploaded datasets live under this directory of the data root; a `path` may not name it (another
# user's upload would be one guess away), only `upload_id` reaches an upload, after an owner check.
UPLOADS_DIR = "uploads"


class _DatasetPath(SpecModel):
    path: str | None = Field(
        None, min_length=1, max_length=1024, description="File path relative to the service's data root; or give `upload_id`."
    )
    upload_id: int | None = Field(
        None, ge=1, le=2**63 - 1, description="A dataset you uploaded with POST /v1/datasets; or give `path`."
    )
    tokenizer: Literal["char", "byte"] = Field("char", description="`char`: vocabulary of the data's characters; `byte`: 256 byte values.")
    tokenizer_file: str | None = Field(
        None, min_length=1, max_length=1024,
        description="Instead of `tokenizer`: a Hugging Face `tokenizers` tokenizer.json under the data root (such as the one "
        "beside a pretrained `hf` model); texts are encoded without special tokens. Needs the `hf` extra.",
    )
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5, description="Tail fraction held out for evaluation.")

    @field_validator("path", "tokenizer_file")
    @classmethod
    def _relative_inside_root(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path is None:
            return path
        # The full check (resolves inside the data root, exists) needs the server's data root;
        # this one rejects what can never be right wherever the root is.
        p = PurePosixPath(relative_inside_root(path, info=info))
        if p.parts and p.parts[0] == UPLOADS_DIR:
            raise ValueError(f"must not be under {UPLOADS_DIR}/: name an uploaded dataset by `upload_id`")
        return path

    @model_validator(mode="after")
    def _path_or_upload(self):
        if (self.path is None) == (self.upload_id is None):
            raise ValueError("dataset: give exactly one of `path` and `upload_id`")
        return self

    @property
    def relative_path(self) -> str:
        """The file, relative to the data root, whichever way the spec names it."""
        return self.path if self.path is not None else f"{UPLOADS_DIR}/{self.upload_id}"


class _CorpusWindows(SpecModel):
    windows: Literal["random", "aligned"] = Field(
        "random",
        description="How a language model's training samples are cut from the corpus. `random`: each window starts at a "
        "token offset drawn from the seed, afresh every epoch (nanoGPT's sampling), so repeated epochs see new windows; "
        "`aligned`: the same non-overlapping windows every epoch, shuffled. Either way a pure function of "
        "(seed, epoch, index), so resume and process counts give the same samples. Evaluation always reads aligned windows.",
    )


class DatasetConfig(_DatasetPath, _CorpusWindows):
    """A plain-text corpus, tokenised per character or per byte."""

    kind: Literal["text"] = Field(
        description="`text`: one corpus for a language model; `jsonl`/`csv`: labelled texts (LabelledDatasetConfig); "
        "`hf_disk`: a `datasets` directory (DiskDatasetConfig)."
    )

    tasks: ClassVar[tuple[str, ...]] = ("lm",)


class LabelledDatasetConfig(_DatasetPath):
    """Labelled texts for a classifier: JSON lines or a CSV file with a header row."""

    kind: Literal["jsonl", "csv"] = Field(description="File format.")
    text_column: str = Field("text", min_length=1, max_length=200, description="Field holding each text.")
    label_column: str = Field("label", min_length=1, max_length=200, description="Field holding each label (any strings or numbers).")
    shuffle: bool = Field(
        True, description="Shuffle each epoch (by training.seed); false: the rows in the file's order, for data shuffled or ordered on purpose."
    )

    tasks: ClassVar[tuple[str, ...]] = ("classify",)


class DiskDatasetConfig(_DatasetPath, _CorpusWindows):
    """A Hugging Face `datasets` directory written by `save_to_disk`, read with `load_from_disk`: labelled
    texts for a classifier, or the texts of `text_column` joined by newlines for a language model."""

    kind: Literal["hf_disk"] = Field(description="A `datasets` directory.")
    path: str = Field(min_length=1, max_length=1024, description="Directory path relative to the service's data root.")
    split: str | None = Field(
        None, min_length=1, max_length=200, description="For a DatasetDict: the split to train on (val_fraction of it is held out)."
    )
    text_column: str = Field("text", min_length=1, max_length=200, description="Column holding each text.")
    label_column: str = Field("label", min_length=1, max_length=200, description="Classifiers: column holding each label (a ClassLabel's names are used).")

    tasks: ClassVar[tuple[str, ...]] = ("lm", "classify")


class FSDPConfig(SpecModel):
    """Options of the `fsdp` strategy: torch's FSDP2 (`fully_shard`), one unit per transformer block."""

    reshard_after_forward: bool = Field(
        True, description="Free each block's gathered parameters after its forward (gather again for backward): less memory, more communication."
    )
    # No float16: without a loss scaler its gradients underflow (training.precision `fp16` has one, `ddp` only).
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Mixed precision: the dtype blocks compute in (parameters are kept and stepped in float32)."
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field("float32", description="The dtype gradients are reduce-scattered in.")
    cpu_offload: bool = Field(False, description="Keep sharded parameters, gradients and optimizer state in (pinned) CPU memory (cuda only).")
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations in backward instead of keeping them: less memory, about one more forward."
    )


class GuardConfig(SpecModel):
    """The loss guard: a run that diverges rolls back instead of training on (workers/loss_guard.py).
    A non-finite loss or gradient norm, or a loss above `spike_factor` × the median of the last
    `window` steps (and `min_increase` above it) for `spike_steps` steps in a row, stops the attempt; the job resumes from its last
    checkpoint before the spike began, skipping the batches trained between that checkpoint and the
    spike's last step."""

    enabled: bool = Field(True, description="Watch the loss and roll back a spike or NaN; false: train on whatever happens.")
    spike_factor: float = Field(3.0, gt=1.0, le=1000.0, description="A step's loss this many times the recent median is a spike step…")
    min_increase: float = Field(
        0.5, ge=0.0, le=1000.0, description="…when it is also at least this much above the median: a loss near zero triples by noise alone."
    )
    window: int = Field(50, ge=5, le=100_000, description="Steps the recent median is taken over; no spike is called before this many.")
    spike_steps: int = Field(3, ge=1, le=10_000, description="Spike steps in a row that make a spike (a non-finite loss or norm: one).")
    max_rollbacks: int = Field(3, ge=0, le=100, description="Rollbacks a job may take; the next spike fails it, saying why.")
    metric: str | None = Field(
        None, min_length=1, max_length=64,
        description="A `script`'s or `custom` loop's: the metric it logs its loss as (default: `train_loss`, else `loss`), watched by "
        "the worker; on a spike the job goes on from its checkpoint saved before it, through its own resume (skipping data is its own: "
        "a custom loop is told how many steps' batches in `skip_steps`).",
    )


class TrainingConfig(SpecModel):
    """How the loop runs. A step is one optimizer step."""

    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="`ddp`: every process holds the whole model, its gradients and optimizer state; `fsdp`: they are sharded "
        "across processes (torch FSDP2, per transformer block; `fsdp` holds its options). Built-in models only.",
    )
    fsdp: FSDPConfig | None = Field(None, description="Options of strategy `fsdp` (defaults when left out).")

    max_steps: int | None = Field(
        None, ge=1, le=10_000_000,
        description="Optimizer steps to train for (required for built-in models; for a `script`, only shown as progress).",
    )
    micro_batch_size: int | None = Field(
        None, ge=1, le=65536, description="Samples per process per forward pass (required for built-in models; a `script` picks its own)."
    )
    gradient_accumulation_steps: int = Field(
        1, ge=1, le=4096,
        description="Micro-batches accumulated per optimizer step (a `script` gets it as ACCELERATE_GRADIENT_ACCUMULATION_STEPS).",
    )
    precision: Literal["no", "fp16", "bf16"] = Field("no", description="Accelerate mixed precision mode (`--mixed_precision`).")
    grad_clip_norm: float | None = Field(None, gt=0.0, description="Clip the global gradient norm to this value; null disables.")
    grad_clip_value: float | None = Field(None, gt=0.0, description="Clamp each gradient element to ±this value; null disables.")
    compile: bool | None = Field(
        None,
        description="Wrap the model with torch.compile (its kernels cached on the worker between jobs). null: on for "
        "`cuda` jobs of strategy `ddp`, off on the CPU, where compiling costs more than it saves on small models; "
        "the job's spec records what was chosen.",
    )
    tf32: bool = Field(
        True, description="On GPUs that have them, float32 matmuls and convolutions in TF32 (10-bit mantissa, float32 range); no effect on the CPU."
    )
    seed: int = Field(1337, ge=0, le=2**32 - 1, description="Seed for weights, data order and dropout.")
    eval_every: int = Field(250, ge=1, description="Evaluate every this many steps, and at the last step over the whole validation split.")
    eval_batches: int | None = Field(
        20, ge=1, le=100_000,
        description="Validation batches per evaluation (per process), spread evenly over the whole validation split (the same "
        "samples in every run of the same data and counts); null: the whole split, every sample once.",
    )
    guard: GuardConfig = Field(
        default_factory=lambda: GuardConfig(), description="Roll back a loss spike or NaN (built-in models); `false` is `{\"enabled\": false}`."
    )

    @field_validator("guard", mode="before")
    @classmethod
    def _guard_on_or_off(cls, value):
        return {"enabled": value} if isinstance(value, bool) else value
    stall_timeout_s: float | None = Field(
        None,
        gt=0.0,
        description=(
            "Fail the attempt (retried under max_restarts, from the latest checkpoint) when no optimizer step "
            "completes (for a `script`: nothing is logged and no checkpoint saved) for this many seconds, counted from the attempt's start for the first step; it must cover "
            "start-up, an evaluation and a checkpoint save. null disables."
        ),
    )


class OptimizerConfig(SpecModel):
    name: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(gt=0.0, le=10.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=10.0, description="Decoupled weight decay (AdamW) or L2 (SGD).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    fused: bool | None = Field(
        None, description="The optimizer's fused kernel: one kernel for every parameter's update. null: on for `cuda` jobs; the spec records what was chosen."
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas


class ScheduleConfig(SpecModel):
    """Learning-rate schedule, defined per optimizer step."""

    name: Literal["constant", "linear", "cosine"] = Field("cosine", description="Schedule shape after warmup.")
    warmup_steps: int | None = Field(None, ge=0, description="Linear warmup steps; null means 10% of max_steps.")
    min_lr: float = Field(0.0, ge=0.0, description="Final learning rate for `cosine` and `linear`.")


class ElasticConfig(SpecModel):
    """Run on fewer processes rather than wait: a queued job that can't get its full size within
    `wait_s` takes the largest size down to `min_processes` that is free, and goes back to its
    full size at a checkpoint when that is free again. Its effective batch, learning-rate schedule
    and order of samples stay those of the full size (accumulation × full/placed)."""

    min_processes: int = Field(ge=1, le=64, description="The fewest processes the job may run on.")
    wait_s: float = Field(300.0, ge=0, le=7 * 86400, description="Seconds a queued job waits for its full size before taking less.")


class ResourcesConfig(SpecModel):
    nodes: int = Field(1, ge=1, le=1024, description="Hosts the job runs on.")
    processes_per_node: int = Field(1, ge=1, le=64, description="Training processes (devices) per host.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Device kind each process uses.")
    min_gpu_memory_gb: float | None = Field(None, gt=0, description="Only GPUs with at least this much memory (cuda only).")
    memory_gb: float | None = Field(
        None, gt=0, le=65536,
        description="Most host memory (RAM) the job's processes on one host may use together, /dev/shm and /tmp "
        "included; past it the kernel kills them and the attempt fails saying so. None: its slots' share of the host "
        "(the host's memory divided by its slots, or the service's TRAINYARD_MEMORY_GB_PER_SLOT).",
    )
    disk_gb: float | None = Field(
        None, gt=0, le=1_048_576,
        description="Most the job's directory on one host may hold (what it writes there: checkpoints, outputs, files); "
        "past it the training is stopped and the job fails saying so, not retried. None: the service's "
        "TRAINYARD_MAX_ATTEMPT_DISK_GB (100 unless its operator says otherwise).",
    )
    max_runtime_hours: float | None = Field(
        None, gt=0, le=8760,
        description="Longest one attempt may run, wall clock from its start; past it the training is stopped (SIGTERM, "
        "then SIGKILL 15 s later) and the job fails saying so, not retried. None: the service's TRAINYARD_MAX_RUNTIME_HOURS "
        "(168 unless its operator says otherwise).",
    )

    elastic: ElasticConfig | None = Field(None, description="May run on fewer processes when its full size isn't free (one node only).")
    pool: str | None = Field(
        None, pattern=r"^[a-z][a-z0-9-]{0,39}$",
        description="A cluster pool to run on instead of the registered hosts: its name as the service's operator configured "
        "it (a Slurm partition: GET /v1/pools lists them). Its cluster places the nodes; None: Trainyard's own hosts.",
    )

    @property
    def slots(self) -> int:
        """The process slots it holds in all, as quotas and the scheduler count them."""
        return self.nodes * self.processes_per_node

    @property
    def slot_kind(self) -> str:
        """The kind of slots it holds, which quotas and fair share count apart: its device on the
        registered hosts (`cpu`, `cuda`), `<pool>/<device>` in a cluster pool (`slurm/cuda`)."""
        return f"{self.pool}/{self.device}" if self.pool else self.device

    @model_validator(mode="after")
    def _gpu_memory_needs_cuda(self) -> ResourcesConfig:
        if self.min_gpu_memory_gb is not None and self.device != "cuda":
            raise ValueError("resources.min_gpu_memory_gb needs device 'cuda'")
        if self.elastic is not None:
            if self.nodes > 1:
                raise ValueError("resources.elastic: one node only (a gang shrinks by hosts, which is not supported)")
            if self.elastic.min_processes > self.processes_per_node:
                raise ValueError(f"resources.elastic.min_processes: at most processes_per_node ({self.processes_per_node})")
            if self.pool is not None:
                raise ValueError("resources.elastic: on Trainyard's own hosts only (a cluster pool places the job at its size)")
        return self


class CheckpointConfig(SpecModel):
    every_steps: int | None = Field(None, ge=1, description="Save every this many steps; the last step is always saved.")
    keep_last: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept per job; older ones are deleted.")
    keep_best: bool = Field(
        False,
        description="Also keep the checkpoint whose step has the best `best_metric` (the lowest `eval_loss` unless said), past "
        "`keep_last` (nanoGPT's `always_save_checkpoint = False`): on a small dataset the last checkpoint can be far worse than the "
        "best. The built-in loop then also saves at every evaluation that beats the best so far; a script or custom loop is covered "
        "where it logs `best_metric` at the steps it checkpoints (another name counts for nothing). Evaluations are compared as "
        "reported: with `eval_batches` set, a sample spread over the split, the last step's over all of it. `trainyard checkpoints` "
        "marks the best.",
    )
    best_metric: str = Field(
        "eval_loss", min_length=1, max_length=64,
        description="The metric `keep_best` ranks checkpoints by, as logged at their steps (Hugging Face's `metric_for_best_model`, "
        "Lightning's `monitor`). The built-in loop evaluates `eval_loss`, and `eval_accuracy` for a classifier.",
    )
    best_mode: Literal["min", "max"] = Field("min", description="`min`: the lowest `best_metric` is best (a loss); `max`: the highest (an accuracy).")

    @model_validator(mode="after")
    def _best_needs_keep_best(self) -> CheckpointConfig:
        if not self.keep_best and (self.best_metric, self.best_mode) != ("eval_loss", "min"):
            raise ValueError("checkpoint.best_metric and best_mode rank checkpoints for keep_best: set keep_best: true, or leave them out")
        return self

    def better(self, value: float, best: float | None) -> bool:
        """Whether `value` of `best_metric` beats the best so far (None: there is none yet)."""
        return best is None or (value < best if self.best_mode == "min" else value > best)


class CodeSource(SpecModel):
    """Where a script's code comes from: a bundle you uploaded, or a directory under the code root."""

    upload_id: int | None = Field(None, ge=1, le=2**63 - 1, description="A code bundle uploaded with POST /v1/code.")
    path: str | None = Field(
        None, min_length=1, max_length=1024, description="A directory relative to the service's code root (TRAINYARD_CODE_ROOT)."
    )

    @field_validator("path")
    @classmethod
    def _relative(cls, path: str | None, info: ValidationInfo) -> str | None:
        return None if path is None else relative_inside_root(path, "the code root", info)

    @model_validator(mode="after")
    def _one_source(self) -> CodeSource:
        if (self.path is None) == (self.upload_id is None):
            raise ValueError("script.code: give exactly one of `upload_id` and `path`")
        return self


# A package name and optional version specifiers, e.g. `transformers>=4.40,<5`: no URLs, paths or markers.
REQUIREMENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*( *(===|==|!=|<=|>=|~=|<|>) *[A-Za-z0-9.*+!_-]+( *, *(===|==|!=|<=|>=|~=|<|>) *[A-Za-z0-9.*+!_-]+)*)?$"


ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
# What the worker sets in a script's environment itself (workers/launch.py), besides TRAINYARD_*,
# and what torch's launcher sets for each process (a job that set LOCAL_RANK failed every attempt).
SCRIPT_RESERVED_ENV = frozenset({
    "ACCELERATE_USE_CPU", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
})
RESERVED_ENV_PREFIXES = ("TRAINYARD_", "TORCHELASTIC_")


class ScriptConfig(SpecModel):
    """Your own Accelerate training script, run as `accelerate launch <entrypoint> <args>` with the
    job's processes, precision and accumulation. It reports through `accelerator.log` and
    checkpoints with `accelerator.save_state`; nothing else in it needs to change."""

    entrypoint: str = Field(min_length=1, max_length=1024, description="The script, relative to the code directory, e.g. `train.py`.")
    args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=256, description="Arguments after the script, as a list (no shell)."
    )
    code: CodeSource
    resume_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "Appended to `args` when the attempt resumes, with `{checkpoint}` replaced by the checkpoint directory, e.g. "
            "`[\"--resume_from_checkpoint\", \"{checkpoint}\"]`. The directory keeps the name the script saved it under "
            "(`…/step_1200`), so a script that parses its own folder names resumes unchanged. `{checkpoint_name}` is that "
            "name, `{step}` the checkpoint's step. The directory is also in TRAINYARD_RESUME_FROM either way."
        ),
    )
    env: dict[Annotated[str, Field(pattern=ENV_NAME_PATTERN, max_length=128)], Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict,
        max_length=64,
        description=(
            "Environment variables for the script, e.g. `{\"HF_HUB_OFFLINE\": \"1\"}`, given to the job's own processes "
            "only, inside its sandbox: names that change how programs load (LD_PRELOAD, PATH, PYTHONPATH...) are allowed "
            "and act there alone, never on the worker's programs that build the sandbox. Names Trainyard sets itself "
            "(`TRAINYARD_*`, the launcher's ACCELERATE_USE_CPU and ACCELERATE_GRADIENT_ACCUMULATION_STEPS, "
            "CUDA_VISIBLE_DEVICES, PYTHONUNBUFFERED) are refused; a PYTHONPATH comes after Trainyard's own."
        ),
    )
    outputs: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "Directories the script writes, relative to its working directory (e.g. `[\"out\"]` for `--output_dir out`), "
            "collected into the artifact store with a sha256 manifest when the job succeeds: `GET /v1/jobs/{id}/outputs`, "
            "`trainyard outputs ID`. Symbolic links and special files in them are left out."
        ),
    )
    outputs_at_checkpoints: bool = Field(
        False, description="Also collect `outputs` after each checkpoint, so a job that fails later still has them (the latest collection wins)."
    )

    requirements: list[Annotated[str, Field(pattern=REQUIREMENT_PATTERN, max_length=200)]] = Field(
        default_factory=list,
        max_length=64,
        description=(
            "Packages the script needs, as `name` or `name>=version` (PEP 440 specifiers): checked, never installed (to "
            "install one, name it in `environment.pip`). Each must be one the workers provide (TRAINYARD_SCRIPT_PACKAGES) "
            "or one `environment.pip` names, checked at submit, and its version in the job's environment must satisfy the "
            "specifier on the host that runs it, or the attempt fails saying which."
        ),
    )

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_inside(cls, entrypoint: str, info: ValidationInfo) -> str:
        return relative_inside_root(entrypoint, "the code directory", info)

    @field_validator("outputs")
    @classmethod
    def _outputs_inside(cls, outputs: list[str], info: ValidationInfo) -> list[str]:
        outputs = [str(PurePosixPath(relative_inside_root(output, "the script's working directory", info))) for output in outputs]
        if "." in outputs:
            raise ValueError("name a directory inside the working directory, not the directory itself")
        if len(set(outputs)) != len(outputs):
            raise ValueError("each directory once")
        return outputs

    @field_validator("env")
    @classmethod
    def _env_not_trainyards(cls, env: dict[str, str]) -> dict[str, str]:
        # The service's own settings and credentials are TRAINYARD_*: a script can neither see nor set them.
        if refused := sorted(name for name in env if name.upper().startswith(RESERVED_ENV_PREFIXES) or name in SCRIPT_RESERVED_ENV):
            raise ValueError(f"{', '.join(refused)}: set by Trainyard itself, not by a job")
        return env  # (a NUL character in one: SpecModel refuses it)


# One `environment.pip` requirement: a package name, optional extras and version specifiers, e.g.
# `tiktoken==0.7` or `peft[torch]>=0.11,<1`. No URLs, paths or markers: only what the worker's
# index and find-links serve is installed.
PIP_REQUIREMENT_PATTERN = (
    r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[ *[A-Za-z0-9][A-Za-z0-9._-]*( *, *[A-Za-z0-9][A-Za-z0-9._-]*)* *\])?"
    r"( *(===|==|!=|<=|>=|~=|<|>) *[A-Za-z0-9.*+!_-]+( *, *(===|==|!=|<=|>=|~=|<|>) *[A-Za-z0-9.*+!_-]+)*)?$"
)


def _pip_requirement(requirement: str) -> str:
    if not re.fullmatch(PIP_REQUIREMENT_PATTERN, requirement):
        raise ValueError(
            f"{requirement!r}: expected `name`, `name==1.2` or `name[extra]>=1,<2` (a package name with extras and version "
            "specifiers; no URL, path, option or marker)"
        )
    return requirement


# The worker's own, which the training loop and the script hooks are built against: never replaced.
WORKER_OWN_PACKAGES = ("torch", "accelerate")


class EnvironmentConfig(SpecModel):
    """Packages installed for this job alone, in a virtualenv the worker builds with uv over its own
    environment (so the worker's torch and accelerate are used, never reinstalled) and caches by
    (requirements, Python version, worker environment) for the next job that asks for the same."""

    pip: list[Annotated[str, Field(max_length=200), AfterValidator(_pip_requirement)]] = Field(
        min_length=1,
        max_length=64,
        description=(
            "Requirements as `name`, `name==1.2` or `name[extra]>=1,<2` (PEP 440 specifiers), installed from the "
            "worker's index and find-links (TRAINYARD_ENVIRONMENT_INDEX_URL, TRAINYARD_ENVIRONMENT_FIND_LINKS) as wheels only. "
            "torch and accelerate stay at the worker's versions. A package that cannot be installed fails the attempt, naming it."
        ),
    )

    @field_validator("pip")
    @classmethod
    def _each_package_once(cls, pip: list[str]) -> list[str]:
        names = [re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower() for requirement in pip]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"{', '.join(repeated)}: name each package once (join its specifiers with commas)")
        if own := [name for name in names if name in WORKER_OWN_PACKAGES]:
            raise ValueError(f"{', '.join(own)}: the worker's own version is used (the training is built against it); leave it out")
        return pip


# The training fields a `script` job uses: the launcher's settings, and the service's own watch.
SCRIPT_TRAINING_FIELDS = {"max_steps", "gradient_accumulation_steps", "precision", "stall_timeout_s"}


class JobSpec(SpecModel):
    """Everything needed to run a training job, as POSTed to /v1/jobs."""

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Human-readable job name.")
    model: Annotated[ModelConfig | MLPConfig | HFModelConfig | CustomConfig, Field(discriminator="kind")] | None = Field(
        None, description="The model to train; leave out for a `script` job."
    )
    dataset: Annotated[DatasetConfig | LabelledDatasetConfig | DiskDatasetConfig, Field(discriminator="kind")] | None = Field(
        None, description="The data; leave out for a `script` job, and optional for a `custom` one (it may make its own)."
    )
    script: ScriptConfig | None = Field(None, description="Run your own Accelerate script instead of a built-in model.")
    environment: EnvironmentConfig | None = Field(
        None, description="Extra Python packages for this job (any kind: built-in, `custom`, `script`), installed on the worker and cached there."
    )
    training: TrainingConfig = Field(default_factory=lambda: TrainingConfig())
    optimizer: OptimizerConfig | None = Field(None, description="Required for built-in and custom models; a `script` makes its own.")
    schedule: ScheduleConfig = Field(default_factory=lambda: ScheduleConfig())
    resources: ResourcesConfig = Field(default_factory=lambda: ResourcesConfig())
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CheckpointConfig())
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first.")
    team: str | None = Field(
        None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="The team it runs under, one of yours: its device quota and fair share decide when it runs. "
        "Left out: your default team (none if you are in no team).",
    )
    max_restarts: int = Field(3, ge=0, le=100, description="Retries after a failed or lost attempt.")
    preemptible: bool = Field(
        False, description="May be stopped for a higher-priority job: it checkpoints, goes back to the queue and resumes from there."
    )
    inputs_sha256: dict[Annotated[str, Field(max_length=1000)], Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] | None = Field(
        None, max_length=50,
        description="The sha256 each input must have when an attempt starts, by its name in a run record (RunEnvironment.inputs); "
        "`trainyard rerun` sets it from the job it reruns. An input that differs fails the attempt, naming it, not retried.",
    )

    @model_serializer(mode="wrap")
    def _without_what_a_script_decides(self, serialize):
        """A `script` job's spec as written, stored and shown without the settings its script decides
        (the schedule, the built-in loop's training fields): at their defaults they are noise in
        `trainyard spec` and `compare`, and a spec read back gets the same defaults again."""
        data = serialize(self)
        if self.script is not None and isinstance(data, dict):
            data.pop("schedule", None)
            if isinstance(training := data.get("training"), dict):
                data["training"] = {name: value for name, value in training.items() if name in SCRIPT_TRAINING_FIELDS}
        return data

    @model_validator(mode="after")
    def _cross_field_rules(self) -> JobSpec:
        if self.training.precision == "fp16" and self.resources.device == "cpu":
            raise ValueError("training.precision: fp16 needs device 'cuda' (use 'bf16' or 'no' on CPU)")
        if self.script is not None:
            if given := [name for name in ("model", "dataset", "optimizer") if getattr(self, name) is not None]:
                raise ValueError(f"script: a script job brings its own model, data and optimizer; leave out {', '.join(given)}")
            # The script decides these itself: a value other than the default would be silently ignored.
            # (Compared with the defaults, not fields_set: a stored spec is re-read with every field.)
            ignored = [
                f"training.{name}" for name, field in TrainingConfig.model_fields.items()
                if name not in SCRIPT_TRAINING_FIELDS and getattr(self.training, name) != field.get_default(call_default_factory=True)
            ]
            ignored += ["schedule"] if self.schedule != ScheduleConfig() else []
            ignored += ["checkpoint.every_steps"] if self.checkpoint.every_steps is not None else []
            if ignored:
                raise ValueError(f"script: {', '.join(ignored)} would have no effect on a script job (it decides them itself); leave them out")
            if self.resources.elastic is not None:
                raise ValueError("resources.elastic: a script decides its own batch, so it can't keep it on fewer processes; built-in models only")
            return self
        needed = ("model", "optimizer", "training.max_steps", "training.micro_batch_size")
        if missing := [name for name in needed if _dotted(self, name) is None]:
            raise ValueError(f"{', '.join(missing)}: required (or give `script` to run your own code)")
        if self.dataset is None:
            if self.model.kind != "custom":
                raise ValueError("dataset: required, except for a `custom` model")
        elif self.model.task != "custom" and self.model.task not in self.dataset.tasks:
            raise ValueError(
                "dataset.kind: a language model (`gpt`, an `hf` causal LM) trains on a `text` or `hf_disk` dataset, "
                "a classifier (`mlp`, an `hf` …ForSequenceClassification) on `jsonl`, `csv` or `hf_disk`"
            )
        self._strategy_fits()
        self._elastic_fits()
        if self.checkpoint.keep_best and self.model.kind != "custom" and self.checkpoint.best_metric not in self.evaluated_metrics():
            raise ValueError(
                f"checkpoint.best_metric: the built-in loop evaluates {' and '.join(self.evaluated_metrics())} for this model, "
                f"not {self.checkpoint.best_metric!r}"
            )
        if self.training.grad_clip_norm and self.training.grad_clip_value:
            raise ValueError("training: set grad_clip_norm or grad_clip_value, not both")
        if self.schedule.warmup_steps is not None and self.schedule.warmup_steps >= self.training.max_steps:
            raise ValueError("schedule.warmup_steps must be smaller than training.max_steps")
        if self.schedule.min_lr > self.optimizer.lr:
            raise ValueError("schedule.min_lr must not exceed optimizer.lr")
        self._choose_engine_defaults()
        return self

    def _choose_engine_defaults(self) -> None:
        """The GPU defaults (compile, fused optimizer), written into the spec so the job records them."""
        on_gpu = self.resources.device == "cuda"
        if self.training.compile is None:
            self.training.compile = on_gpu and self.training.strategy == "ddp" and self.model.kind != "custom"
        if self.optimizer.fused is None:
            self.optimizer.fused = on_gpu

    def _strategy_fits(self) -> None:
        training = self.training
        if training.strategy != "fsdp":
            if training.fsdp is not None:
                raise ValueError("training.fsdp: options of strategy `fsdp`; set training.strategy to `fsdp` or leave them out")
            return
        fsdp = training.fsdp or FSDPConfig()
        if self.model.kind == "custom":
            raise ValueError("training.strategy: `fsdp` shards the built-in models (gpt, mlp, hf); a custom loop prepares its own")
        if training.precision != "no":
            raise ValueError("training.precision: with strategy `fsdp`, set training.fsdp.param_dtype and reduce_dtype instead")
        if self.resources.nodes > 1:
            raise ValueError("resources.nodes: strategy `fsdp` writes every process's shard into one checkpoint directory, so one node only")
        if fsdp.cpu_offload and self.resources.device == "cpu":
            raise ValueError("training.fsdp.cpu_offload: needs device 'cuda' (on the CPU the state is in CPU memory already)")

    def _elastic_fits(self) -> None:
        elastic = self.resources.elastic
        if elastic is None:
            return
        if self.model.kind == "custom":
            raise ValueError("resources.elastic: a custom loop decides its own batch; built-in models only")
        if elastic.min_processes not in self.elastic_sizes():
            raise ValueError(
                f"resources.elastic.min_processes: an optimizer step of {self.effective_batch_size} samples (micro_batch_size "
                f"{self.training.micro_batch_size} × gradient_accumulation_steps {self.training.gradient_accumulation_steps} × "
                f"{self.world_size} processes) cannot be split into whole micro-batches on {elastic.min_processes} processes"
            )

    def evaluated_metrics(self) -> tuple[str, ...]:
        """What the built-in loop's evaluation reports for this job's model (workers/training/evaluate.py)."""
        return ("eval_loss", "eval_accuracy") if self.model.task == "classify" else ("eval_loss",)

    def reported_metrics(self) -> tuple[str, ...]:
        """What the built-in loop reports for this job's model: each step's (workers/training/loop.py)
        and its evaluation's. (The worker adds its samples of the machine, `sys/…`.)"""
        return ("train_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_memory_mb", *self.evaluated_metrics())

    def elastic_sizes(self) -> list[int]:
        """The process counts this job may run on, largest first: its own, and with `resources.elastic`
        each smaller one down to `min_processes` that keeps its optimizer step in whole micro-batches."""
        own, elastic = self.resources.processes_per_node, self.resources.elastic
        if elastic is None:
            return [own]
        return [n for n in range(own, elastic.min_processes - 1, -1) if self.effective_batch_size % (self.training.micro_batch_size * n) == 0]

    def placed_on(self, processes: int) -> JobSpec:
        """The spec to launch this job on `processes` processes with (an elastic job placed smaller).
        The training itself reads the job's own spec and accumulates to keep its optimizer step
        (workers/training/elastic.py)."""
        return self.model_copy(update={"resources": self.resources.model_copy(update={"processes_per_node": processes})})

    @property
    def warmup_steps(self) -> int:
        if self.schedule.warmup_steps is not None:
            return self.schedule.warmup_steps
        return self.training.max_steps // 10

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.processes_per_node

    @property
    def data_paths(self) -> list[str]:
        """The paths under the data root that a built-in or custom job reads: its dataset, tokenizer, model directory."""
        paths = [] if self.dataset is None else [self.dataset.relative_path, getattr(self.dataset, "tokenizer_file", None)]
        return [path for path in [*paths, getattr(self.model, "path", None)] if path]

    @property
    def may_start_warm(self) -> bool:
        """Whether an attempt of it may start from an interpreter loaded before it was known
        (workers/warm_pool.py): the built-in and custom loops (a script runs its own program in its
        own clean environment), on one node (a gang's nodes keep the host's network), on the CPU
        (which GPUs it gets is known only once placed), in the worker's own Python (no `environment`)."""
        return self.script is None and self.environment is None and self.resources.nodes == 1 and self.resources.device == "cpu"

    @property
    def effective_batch_size(self) -> int | None:
        """Samples per optimizer step across all processes; None for a script, which picks its own batch."""
        if self.training.micro_batch_size is None:
            return None
        return self.training.micro_batch_size * self.training.gradient_accumulation_steps * self.world_size


def _dotted(spec: BaseModel, name: str):
    for part in name.split("."):
        spec = getattr(spec, part)
    return spec


# `model` and `dataset` are unions told apart by `kind`; pydantic puts that tag into an error's
# location (`dataset.text.path`). People know the field as `dataset.path`.
_UNION_TAGS = {"model": {"gpt", "mlp", "hf", "custom"}, "dataset": {"text", "jsonl", "csv", "hf_disk"}}


def field_location(loc: tuple | list) -> tuple:
    """An error location as the user wrote the field: without the union's tag."""
    return tuple(part for i, part in enumerate(loc) if not (i and part in _UNION_TAGS.get(loc[i - 1], ())))
