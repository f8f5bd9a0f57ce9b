"""A Slurm pool reached through slurmrestd with a JWT, as a service outside the cluster reaches it:
the scheduler has no SLURM_CONF and no munge, only the REST URL and a token file. A job trains to
the end in Slurm, and a cancel ends its Slurm job (test_slurm.py covers the rest of the lifecycle
the same backend runs, through Slurm's commands)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.test_end_to_end import wait_for, wait_for_step
from tests.e2e.test_slurm import BASE, FINAL, cluster_or_fail, slurm_jobs, stack_on
from tests.helpers import tiny_spec

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def rest_stack(tmp_path_factory):
    cluster = cluster_or_fail()
    try:
        token_file = tmp_path_factory.mktemp("secrets") / "slurm.jwt"
        token_file.write_text(cluster.token())
        with stack_on(cluster, tmp_path_factory.mktemp("yard"), TRAINYARD_SLURM_REST_URL=cluster.start_rest(),
                      TRAINYARD_SLURM_JWT_FILE=str(token_file)) as client:
            yield cluster, client
    finally:
        cluster.stop()


def test_a_job_handed_over_through_slurmrestd_trains_and_a_cancel_ends_its_slurm_job(rest_stack):
    cluster, client = rest_stack
    [pool] = client.get("/v1/pools").json()  # described from slurmrestd's nodes
    assert (pool["backend"], pool["partition"], pool["nodes"]) == ("slurm", "batch", 2)

    job = wait_for(client, client.post("/v1/jobs", json=tiny_spec(**BASE, name="rest-job")).json()["id"], FINAL, timeout=300)
    assert job["status"] == "succeeded", job
    [attempt] = job["attempts"]
    assert attempt["pool"] == "slurm" and attempt["cluster_job_id"] is not None
    assert [c["step"] for c in client.get(f"/v1/jobs/{job['id']}/checkpoints").json()] == [5, 10, 15, 20, 25, 30]

    spec = tiny_spec(**{**BASE, "name": "rest-cancel", "training.max_steps": 100_000, "checkpoint.every_steps": 100_000})
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    wait_for_step(client, job_id, 3)
    [attempt] = client.get(f"/v1/jobs/{job_id}").json()["attempts"]
    assert attempt["cluster_state"] == "RUNNING" and attempt["cluster_job_id"] in slurm_jobs(cluster)
    asked = time.monotonic()
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    while attempt["cluster_job_id"] in slurm_jobs(cluster):
        assert time.monotonic() - asked < 10, slurm_jobs(cluster)
        time.sleep(0.2)
    assert wait_for(client, job_id, FINAL, timeout=30)["status"] == "cancelled"
