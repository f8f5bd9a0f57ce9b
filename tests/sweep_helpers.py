"""A sweep's controller driven without workers: the scheduler's and the workers' part played step by
step, with a made-up objective curve (service and client tests)."""

from __future__ import annotations

from sqlalchemy import select

from api_schemas import AttemptStatus, SweepStatus
from service.db.attempts import ClaimedAttempt, claim_attempt, finish_attempt, renew_lease
from service.db.checkpoints import record_checkpoint
from service.db.hosts import register_host
from service.db.metrics import record_metrics
from service.db.models import Job, Sweep
from service.db.session import session_factory
from service.scheduler import schedule_pass
from service.sweeps import advance_sweep
from tests.helpers import tiny_spec

EVAL_EVERY = 4
MAX_STEPS = 16


def sweep_spec(**overrides) -> dict:
    spec = {
        "name": "search",
        "base": tiny_spec(**{"training.max_steps": MAX_STEPS, "training.eval_every": EVAL_EVERY, "checkpoint.every_steps": EVAL_EVERY}),
        "search_space": {
            "optimizer.lr": {"choice": [0.001, 0.003]},
            "training.micro_batch_size": {"choice": [4, 8]},
        },
        "sampler": {"kind": "grid", "seed": 7},
        "objective": {"metric": "eval_loss", "direction": "min"},
        "budget": {"max_trials": 10, "max_concurrent": 2},
    }
    spec.update(overrides)
    return spec


def loss(params: dict, step: int) -> float:
    """A made-up eval_loss curve: the lower the learning rate's distance from 0.003, the lower it goes."""
    return 1.0 + 100 * abs(params["optimizer.lr"] - 0.003) + 1.0 / step


class Workers:
    """The scheduler's and workers' part for trials: places queued ones on a 4-slot host, claims
    them, reports `loss` every EVAL_EVERY steps (one eval per round) with a checkpoint, stops
    one asked to stop (as the training does at its next checkpoint) and succeeds at MAX_STEPS."""

    def __init__(self, settings):
        self.settings = settings
        self.sessions = session_factory(settings.resolved_database_url)
        self.running: dict[int, tuple[ClaimedAttempt, int]] = {}  # job id: (attempt, last step reported)
        with self.sessions() as session:
            register_host(session, "host-a", "cpu", 4, {})
            session.commit()

    def round(self) -> None:
        with self.sessions() as session:
            for attempt_id, _ in schedule_pass(session, self.settings):
                claimed = claim_attempt(session, attempt_id, "w1", self.settings.lease_seconds)
                self.running[claimed.job_id] = (claimed, 0)
            for job_id, (claimed, step) in list(self.running.items()):
                if renew_lease(session, claimed, self.settings.lease_seconds).preempt_requested:
                    finish_attempt(session, claimed, AttemptStatus.preempted, "asked to stop")
                    del self.running[job_id]
                    continue
                step += EVAL_EVERY
                params = session.get(Job, job_id).trial["params"]
                record_metrics(session, job_id, claimed.attempt_id, [(step, "eval_loss", loss(params, step))])
                record_checkpoint(session, job_id, claimed.attempt_id, step, f"ck/{job_id}/{step}", "0" * 64, 10, keep_last=2)
                self.running[job_id] = (claimed, step)
                if step >= MAX_STEPS:
                    finish_attempt(session, claimed, AttemptStatus.succeeded)
                    del self.running[job_id]


def run_sweep(settings, sweep_id: int, rounds: int = 100, workers: Workers | None = None) -> tuple[Sweep, list[Job]]:
    """Controller passes and worker rounds in turn until the sweep ends (`workers`: those that
    already run some of its trials)."""
    workers = workers or Workers(settings)
    for _ in range(rounds):
        with workers.sessions() as session:
            advance_sweep(session, sweep_id, settings)
            if session.get(Sweep, sweep_id).status != SweepStatus.running:
                break
        workers.round()
    with workers.sessions() as session:
        sweep = session.get(Sweep, sweep_id)
        return sweep, list(session.scalars(select(Job).where(Job.sweep_id == sweep_id).order_by(Job.trial_number)))
