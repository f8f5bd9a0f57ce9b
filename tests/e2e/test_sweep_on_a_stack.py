"""A sweep through the whole embedded stack (SQLite): its trials train the char-GPT as ordinary
jobs, ASHA prunes the one with a hopeless learning rate at a checkpoint, and a scheduler
restarted mid-sweep goes on with no trial duplicated or lost."""

from __future__ import annotations

import time

import httpx
import pytest

from stack.embedded import embedded_stack
from tests.helpers import tiny_spec
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)

# Long enough that a stop (eval -> worker sync -> controller pass -> worker sync, each up to half
# a second, more on two loaded cores) lands well before the end: 120 steps ran out first in CI.
MAX_STEPS = 600


def test_an_asha_sweep_prunes_the_bad_learning_rate_early_and_survives_a_scheduler_restart(tmp_path, monkeypatch):
    # The controller acts at each scheduler pass and a worker sees a stop at its lease renewal:
    # both often, so that the pruned trial stops long before its last step.
    monkeypatch.setenv("TRAINYARD_SCHEDULER_INTERVAL_SECONDS", "0.5")
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
    base = tiny_spec(**{
        "training.max_steps": MAX_STEPS, "training.eval_every": 10, "checkpoint.every_steps": 10,
        "schedule.warmup_steps": 5, "schedule.min_lr": 1e-7,
    })
    spec = {
        "name": "lr-search",
        "base": base,
        # 1e-6 learns nothing in 600 steps. Seed 3 orders this grid 0.002, 0.003, 1e-6: the bad one
        # comes when the others have set the bar at the first rung (ASHA lets the first through).
        "search_space": {"optimizer.lr": {"choice": [0.003, 0.002, 1e-6]}},
        "sampler": {"kind": "grid", "seed": 3},
        "objective": {"metric": "eval_loss", "direction": "min"},
        "budget": {"max_trials": 3, "max_concurrent": 1},
        "pruner": {"kind": "asha", "min_steps": 10, "reduction_factor": 3},
    }
    with embedded_stack(tmp_path / "yard", free_port(), workers=1) as stack:
        client = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.token}"}, timeout=30)
        response = client.post("/v1/sweeps", json=spec)
        assert response.status_code == 201, response.text
        sweep_id = response.json()["id"]

        sweep = wait_for_sweep(client, sweep_id, lambda s: any(t["status"] == "running" for t in s["trials"][1:]))
        stack.restart("scheduler")  # mid-sweep: trial 1 running, trial 2 not yet asked for
        sweep = wait_for_sweep(client, sweep_id, lambda s: s["status"] != "running")

        assert sweep["status"] == "succeeded", sweep
        trials = sweep["trials"]
        assert [t["number"] for t in trials] == [0, 1, 2]
        assert [t["params"]["optimizer.lr"] for t in trials] == [0.002, 0.003, 1e-6]
        jobs = [job for job in client.get("/v1/jobs").json()["items"] if job["sweep_id"] == sweep_id]
        assert sorted(job["trial_number"] for job in jobs) == [0, 1, 2]  # none duplicated, none lost
        # The first trial at a rung always goes on; the second only if it beats the first there,
        # which at step 10 between two good learning rates is a matter of noise.
        assert trials[0]["status"] == "succeeded" and trials[1]["status"] in ("succeeded", "pruned")
        assert trials[2]["status"] == "pruned"
        bad = trials[2]
        assert bad["reason"].startswith("pruned by the sweep's asha pruner at step 10: eval_loss")
        assert bad["step"] < MAX_STEPS
        assert client.get(f"/v1/jobs/{bad['job_id']}/checkpoints").json(), "a pruned trial keeps its checkpoints"
        assert sweep["best_trial"] in (0, 1) and sweep["best_spec"]["optimizer"]["lr"] in (0.002, 0.003)
        client.close()


def wait_for_sweep(client: httpx.Client, sweep_id: int, done, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sweep = client.get(f"/v1/sweeps/{sweep_id}").json()
        if done(sweep):
            return sweep
        time.sleep(0.5)
    raise TimeoutError(f"sweep {sweep_id}: {sweep}")
