"""An elastic job through the whole stack: placed on one process while another job holds half the
worker, it goes back to two processes at a checkpoint when that job ends, and trains the same
weights as the same job run on two processes from the start (the embedded stack, SQLite)."""

from __future__ import annotations

import httpx
import pytest
from safetensors.torch import load as safetensors_load

from service.embedded import embedded_stack
from tests.e2e.test_end_to_end import wait_for, wait_for_step
from tests.helpers import tiny_spec
from tests.training.test_sharding import relative_difference
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-5  # as tests/training/test_elastic.py: ddp measured 0 both ways
STEPS = 6000  # about 25 s on one process here: still running when the blocker has gone (two heartbeats or so)


def final_weights(client: httpx.Client, job_id: int) -> dict:
    latest = client.get(f"/v1/jobs/{job_id}/checkpoints").json()[-1]
    return safetensors_load(client.get(f"/v1/checkpoints/{latest['id']}/download").content)


def test_an_elastic_job_placed_on_one_process_goes_back_to_two_and_trains_the_two_process_weights(tmp_path):
    # Long enough (a few ms a step) to be still running when the other job is cancelled.
    spec = tiny_spec(name="elastic", **{
        "resources.processes_per_node": 2, "training.max_steps": STEPS, "training.eval_every": STEPS, "checkpoint.every_steps": 200,
        "resources.elastic": {"min_processes": 1, "wait_s": 0},
    })
    with embedded_stack(tmp_path / "yard", free_port(), workers=1, devices="cpu:2") as info:
        client = httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30)
        blocker = client.post("/v1/jobs", json=tiny_spec(name="blocker", **{"training.max_steps": 100_000})).json()["id"]
        job = client.post("/v1/jobs", json=spec).json()["id"]

        # Half the worker is the blocker's: the elastic job trains on the other half.
        small = wait_for_step(client, job, 10)
        assert [a["processes"] for a in small["attempts"]] == [1]

        # The blocker goes: the elastic job goes back to two processes at a checkpoint.
        client.post(f"/v1/jobs/{blocker}/cancel").raise_for_status()
        done = wait_for(client, job, {"succeeded", "failed", "cancelled"})
        assert done["status"] == "succeeded", done["failure_reason"]
        first, second = done["attempts"]
        assert (first["processes"], first["status"], second["processes"], second["status"]) == (1, "preempted", 2, "succeeded")
        assert "stopped to go back to its full size of 2 processes" in first["failure_reason"]
        assert 0 < second["resumed_from_step"] < STEPS and done["restarts"] == 0

        # The same job on two processes from the start (the worker is free now).
        reference = client.post("/v1/jobs", json={**spec, "name": "reference"}).json()["id"]
        ran = wait_for(client, reference, {"succeeded", "failed"})
        assert ran["status"] == "succeeded" and [a["processes"] for a in ran["attempts"]] == [2]
        assert relative_difference(final_weights(client, job), final_weights(client, reference)) < RTOL
        client.close()
