"""An elastic job through the whole stack: placed on one process while another job holds half the
worker, it goes back to two processes at a checkpoint when that job ends, and trains the same
weights as the same job run on two processes from the start (the embedded stack, SQLite)."""

from __future__ import annotations

import time

import httpx
import pytest
from safetensors.torch import load as safetensors_load

from stack.embedded import embedded_stack
from tests.e2e.test_end_to_end import wait_for, wait_for_step
from tests.helpers import tiny_spec
from tests.training.test_sharding import relative_difference
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)

RTOL = 1e-5  # as tests/training/test_elastic.py: ddp measured 0 both ways
# Neither job ever reaches its last step: both are compared at the first checkpoint after the
# elastic one grew back, and cancelled there, whatever the machine's speed.
STEPS, EVERY = 1_000_000, 100


def checkpoint_at(client: httpx.Client, job_id: int, step: int, timeout: float = 180) -> dict:
    """The job's checkpoint of `step`, once registered; fails saying why if the job ends first."""
    deadline = time.monotonic() + timeout
    while not (found := [c for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json() if c["step"] == step]):
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] in ("queued", "scheduled", "running"), f"job {job_id} ended with no checkpoint of step {step}: {job}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step} in {timeout} s: {job}"
        time.sleep(0.2)
    return found[0]


def weights_at(client: httpx.Client, job_id: int, step: int) -> dict:
    checkpoint = checkpoint_at(client, job_id, step)
    client.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()  # what follows is not compared
    return safetensors_load(client.get(f"/v1/checkpoints/{checkpoint['id']}/download").content)


def test_an_elastic_job_placed_on_one_process_goes_back_to_two_and_trains_the_two_process_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")  # a worker hears of the stop this soon
    spec = tiny_spec(name="elastic", **{
        "resources.processes_per_node": 2, "training.max_steps": STEPS, "training.eval_every": STEPS,
        "checkpoint.every_steps": EVERY, "checkpoint.keep_last": 10, "resources.elastic": {"min_processes": 1, "wait_s": 0},
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
        deadline = time.monotonic() + 120
        while len((grown := client.get(f"/v1/jobs/{job}").json())["attempts"]) < 2 or grown["attempts"][1]["resumed_from_step"] is None:
            assert grown["status"] in ("queued", "scheduled", "running"), grown
            assert time.monotonic() < deadline, f"never went back to two processes: {grown}"
            time.sleep(0.2)
        first, second = grown["attempts"]
        assert (first["processes"], first["status"], second["processes"]) == (1, "preempted", 2)
        assert "stopped to go back to its full size of 2 processes" in first["failure_reason"]
        resumed = second["resumed_from_step"]
        assert resumed > 0 and grown["restarts"] == 0  # from the checkpoint taken where it stopped
        compared_step = (resumed // EVERY + 2) * EVERY  # over a hundred steps on two processes since
        elastic_weights = weights_at(client, job, compared_step)

        # The same job on two processes from the start (once the worker is free), to the same step.
        fixed_size = {**spec, "name": "reference", "resources": {**spec["resources"], "elastic": None}}
        reference = client.post("/v1/jobs", json=fixed_size).json()["id"]
        reference_weights = weights_at(client, reference, compared_step)
        assert [a["processes"] for a in client.get(f"/v1/jobs/{reference}").json()["attempts"]] == [2]
        assert relative_difference(elastic_weights, reference_weights) < RTOL
        assert wait_for(client, job, {"cancelled", "failed", "succeeded"})["status"] == "cancelled"
        client.close()
