"""Small builders shared by tests."""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from api_schemas import AttemptStatus, JobSpec
from api_schemas.host_api import ClaimedAttempt
from service.db.attempts import claim_attempt, finish_attempt
from service.db.checkpoints import record_checkpoint
from service.db.hosts import register_host
from service.db.metrics import record_metrics
from service.db.models import Attempt
from service.db.session import session_factory
from service.db.state import ACTIVE_ATTEMPT
from service.scheduler import schedule_pass
from common.settings import Settings

EXAMPLE_SPEC = json.loads((Path(__file__).resolve().parent.parent / "examples" / "shakespeare-char.json").read_text())


def spec_dict(**overrides) -> dict:
    """The README's example spec with dotted-path overrides, e.g. spec_dict(**{"training.max_steps": 10})."""
    spec = copy.deepcopy(EXAMPLE_SPEC)
    for dotted, value in overrides.items():
        target = spec
        *parents, leaf = dotted.split(".")
        for key in parents:
            target = target[key]
        target[leaf] = value
    return spec


def tiny_spec(**overrides) -> dict:
    """A job that trains in a few seconds on one CPU core. On Tiny Shakespeare its validation split
    is the last 1% (11k characters), as the last evaluation reads all of it; a test's own corpus
    keeps the example's 10%."""
    if "dataset.path" not in overrides:
        overrides = {"dataset.val_fraction": 0.01, **overrides}
    base = {
        "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16,
        "training.max_steps": 12, "training.micro_batch_size": 4, "training.eval_every": 6, "training.eval_batches": 4,
        "schedule.warmup_steps": 2, "checkpoint.every_steps": 6, "checkpoint.keep_last": 2, "max_restarts": 1,
    }
    return spec_dict(**{**base, **overrides})


def small_spec(**overrides) -> dict:
    """The README's model at half its depth and width, validated on the last 1% (the last
    evaluation reads all of it): about 0.02 s a step on a free core against the README model's 0.1,
    for jobs that must still be mid-run when a test acts on them (a fault, a preemption) for a few
    seconds after their first checkpoint."""
    base = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "dataset.val_fraction": 0.01, "training.eval_batches": 5}
    return spec_dict(**{**base, **overrides})


def auth(token: str) -> dict[str, str]:
    """The header that presents `token` to the API."""
    return {"Authorization": f"Bearer {token}"}


def job_spec(**overrides) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(**overrides))


def start_job(settings: Settings, job_id: int, slots: int = 1) -> ClaimedAttempt:
    """Place the (only) queued job on a host of `slots` slots and claim it, as the scheduler and a worker would."""
    with session_factory(settings.resolved_database_url)() as session:
        register_host(session, "host-a", "cpu", slots, {})
        [(attempt_id, _)] = schedule_pass(session, settings)
        return claim_attempt(session, attempt_id, "w1", settings.lease_seconds)


def finish_job(settings: Settings, claimed: ClaimedAttempt) -> None:
    """Report a checkpoint at step 12, the last metrics, then success."""
    with session_factory(settings.resolved_database_url)() as session:
        record_checkpoint(session, claimed.job_id, claimed.attempt_id, 12, "ck/12", "0" * 64, 10, keep_last=2)
        record_metrics(session, claimed.job_id, claimed.attempt_id, [(12, "train_loss", 2.0)])
        finish_attempt(session, claimed, AttemptStatus.succeeded)


def host_client(settings: Settings, sessions, host_name: str):
    """A worker's client of the worker protocol as host `host_name` (a fresh token), sending to an
    in-process API on `settings`."""
    from fastapi.testclient import TestClient

    from service.api.main import create_app
    from service.db.host_tokens import issue_host_token
    from workers.host_client import HostClient

    with sessions() as session:
        token = issue_host_token(session, host_name)
    return HostClient("http://testserver", token, http=TestClient(create_app(settings)))


def busy_slots_by_host(session: Session) -> dict[str, int]:
    """Process slots that active attempts hold, per host, online or not."""
    busy: dict[str, int] = {}
    for host, slots in session.execute(select(Attempt.host_name, Attempt.slots).where(Attempt.status.in_(ACTIVE_ATTEMPT))):
        busy[host] = busy.get(host, 0) + slots
    return busy


def write_labelled_jsonl(path: Path, examples: int = 300, seed: int = 0) -> None:
    """Texts whose label shows in the letters they use: 'abc' texts are "first", 'def' texts
    "second", 'ghi' texts "third", with shared noise letters. An MLP learns it in a few dozen steps."""
    import random

    rng = random.Random(seed)
    alphabets = {"first": "abc", "second": "def", "third": "ghi"}
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(examples):
            label = rng.choice(sorted(alphabets))
            text = "".join(rng.choice(alphabets[label] + "xyz ") for _ in range(rng.randint(4, 24)))
            f.write(json.dumps({"text": text, "label": label}) + "\n")


def write_poisoned_labels(data: Path, steps: range | list[range], batch: int, examples: int = 1200) -> None:
    """`clean.jsonl` (write_labelled_jsonl); `poisoned.jsonl`, the same with the labels of the rows the
    optimizer steps `steps` (a range, or several) read in file order (`batch` rows a step) swapped, so a
    classifier that has learnt the rest spikes there; `without.jsonl`, the same with those rows removed."""
    write_labelled_jsonl(data / "clean.jsonl", examples=examples)
    rows = (data / "clean.jsonl").read_text().splitlines()
    window = {row for each in ([steps] if isinstance(steps, range) else steps) for row in range((each.start - 1) * batch, (each.stop - 1) * batch)}
    swap = {"first": "second", "second": "third", "third": "first"}
    poisoned = [json.dumps({**json.loads(row), "label": swap[json.loads(row)["label"]]}) if i in window else row for i, row in enumerate(rows)]
    (data / "poisoned.jsonl").write_text("\n".join(poisoned) + "\n")
    (data / "without.jsonl").write_text("\n".join(row for i, row in enumerate(rows) if i not in window) + "\n")


def guarded_classifier_spec(path: str, steps: int = 60, every: int = 10, batch: int = 8) -> dict:
    """A classifier reading `path` in file order, checkpointing every `every` steps, with a loss guard
    quick to act (a 10-step median, 3 spike steps): for write_poisoned_labels' files."""
    return classifier_spec(path, **{
        "training.max_steps": steps, "training.micro_batch_size": batch, "checkpoint.every_steps": every, "checkpoint.keep_last": 10,
        "training.eval_every": steps, "optimizer.lr": 0.01, "dataset.shuffle": False,
        "training.guard": {"window": 10, "spike_factor": 3.0, "spike_steps": 3},
    })


def classifier_spec(path: str = "labels.jsonl", **overrides) -> dict:
    """tiny_spec with an `mlp` classifier on a labelled JSON-lines file."""
    model = {"kind": "mlp", "num_labels": 3, "max_length": 16, "n_embd": 16, "hidden": 32, "n_layer": 1}
    dataset = {"kind": "jsonl", "path": path, "val_fraction": 0.2}
    return tiny_spec(**{"model": model, "dataset": dataset, "training.micro_batch_size": 8, **overrides})


@contextlib.contextmanager
def directory_on_another_filesystem(than: Path) -> Iterator[Path]:
    """A temporary directory that a rename from `than` cannot reach, so files must be copied across."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == than.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own (Linux)")
    with tempfile.TemporaryDirectory(dir=shm) as elsewhere:
        yield Path(elsewhere)
