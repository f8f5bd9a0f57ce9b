"""The training engine: an Accelerate loop that reports through a Reporter and knows nothing of the service."""

from api_schemas.worker_protocol import EXIT_PREEMPTED
from workers.training.checkpoint import CheckpointWriter, load_model, load_model_from_checkpoint
from workers.training.data import LabelledTexts, SpecError, Tokenizer, TokenWindows, load_labelled_corpus, load_text_corpus
from workers.training.evaluate import eval_dataloader, evaluate, evaluate_metrics
from workers.training.loop import TrainResult, train
from workers.training.model import GPT, MLPClassifier, build_model
from workers.training.reporter import ConsoleReporter, JsonlReporter, Reporter, reporter_from_env
from workers.training.schedule import lr_at

__all__ = [
    "GPT", "ConsoleReporter", "EXIT_PREEMPTED", "JsonlReporter", "LabelledTexts", "MLPClassifier", "Reporter", "SpecError",
    "CheckpointWriter", "TokenWindows", "Tokenizer", "TrainResult", "build_model", "eval_dataloader", "evaluate", "evaluate_metrics", "load_labelled_corpus",
    "load_model", "load_model_from_checkpoint", "load_text_corpus", "lr_at", "reporter_from_env", "train",
]
