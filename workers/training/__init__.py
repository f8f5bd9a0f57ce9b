"""The training engine: an Accelerate loop that reports through a Reporter and knows nothing of the service."""

from api_schemas.worker_protocol import EXIT_PREEMPTED
from workers.training.checkpoint import load_model, load_model_from_checkpoint, save_checkpoint
from workers.training.data import SpecError, Tokenizer, TokenWindows, load_text_corpus
from workers.training.evaluate import eval_dataloader, evaluate
from workers.training.loop import TrainResult, train
from workers.training.model import GPT
from workers.training.reporter import ConsoleReporter, JsonlReporter, Reporter, reporter_from_env
from workers.training.schedule import lr_at

__all__ = [
    "GPT", "ConsoleReporter", "EXIT_PREEMPTED", "JsonlReporter", "Reporter", "SpecError", "TokenWindows",
    "Tokenizer", "TrainResult", "eval_dataloader", "evaluate", "load_model", "load_model_from_checkpoint", "load_text_corpus",
    "lr_at", "reporter_from_env", "save_checkpoint", "train",
]
