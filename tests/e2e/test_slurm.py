"""Jobs in a Slurm pool, on a real Slurm cluster (tests/slurm_cluster.py: slurmctld and two slurmd
nodes on this machine, loopback only). The stack runs no worker host of its own: every job here
is handed to Slurm by the scheduler (through slurmrestd with a JWT), and run in the allocation by
one agent per node (workers/slurm_agent.py) that reaches the service only over its API, with its
try's token; a one-node try's agent starts loading torch as it starts (--warm)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from stack.embedded import embedded_stack
from tests.browser import ARTIFACTS
from tests.e2e.test_end_to_end import wait_for, wait_for_step
from tests.e2e.test_faults import assert_trained_alike, final_weights
from tests.helpers import tiny_spec
from tests.slurm_cluster import NODES, SlurmCluster, SlurmUnavailable
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(600)

STEPS = 30
BASE = {"training.max_steps": STEPS, "training.eval_every": 10, "checkpoint.every_steps": 5, "checkpoint.keep_last": 10, "resources.pool": "slurm"}
FINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(scope="module")
def slurm_stack(tmp_path_factory):
    """A Slurm cluster, and a stack whose scheduler hands `resources.pool: slurm` jobs to its `batch`
    partition through slurmrestd with a JWT, as a service outside the cluster reaches it: no
    SLURM_CONF, no munge key. (Its commands, the other way in, do the same four calls:
    tests/service/test_slurm_clients.py tries both against this kind of cluster.)"""
    cluster = cluster_or_fail()
    try:
        token_file = tmp_path_factory.mktemp("secrets") / "slurm.jwt"
        token_file.write_text(cluster.token())
        rest = {"TRAINYARD_SLURM_REST_URL": cluster.start_rest(), "TRAINYARD_SLURM_JWT_FILE": str(token_file)}
        with stack_on(cluster, tmp_path_factory.mktemp("yard"), **rest) as client:
            yield cluster, client
    finally:
        cluster.stop()


def cluster_or_fail() -> SlurmCluster:
    try:
        return SlurmCluster.start_new()
    except SlurmUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no Slurm cluster: {exc}")
        pytest.skip(f"no Slurm cluster: {exc}")


@contextlib.contextmanager
def stack_on(cluster: SlurmCluster, directory: Path, **environment: str) -> Iterator[httpx.Client]:
    """A stack with no worker host, whose scheduler runs the `slurm` pool on the cluster's `batch`
    partition, reaching Slurm as `environment` says (SLURM_CONF: its commands; the REST settings: slurmrestd)."""
    saved = dict(os.environ)
    os.environ.update({
        "TRAINYARD_SLURM_PARTITION": "batch", **environment,
        "TRAINYARD_HEARTBEAT_SECONDS": "1",  # how often an agent looks at its lease (5 s in production)
    })
    try:
        with embedded_stack(directory, free_port(), workers=0) as info:
            with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
                deadline = time.monotonic() + 30
                while not client.get("/v1/pools").json():  # the scheduler describes the partition as it starts
                    assert time.monotonic() < deadline, "the scheduler did not describe the Slurm pool"
                    time.sleep(0.2)
                yield client
    finally:
        os.environ.clear()
        os.environ.update(saved)


def slurm_jobs(cluster: SlurmCluster, states: str = "PENDING,RUNNING,COMPLETING") -> dict[str, str]:
    out = cluster.run("squeue", "--noheader", f"--states={states}", "--format=%i|%j")
    return dict(line.split("|") for line in out.split())


def test_the_pool_and_what_it_refuses(slurm_stack):
    cluster, client = slurm_stack
    [pool] = client.get("/v1/pools").json()
    assert (pool["name"], pool["backend"], pool["partition"], pool["nodes"]) == ("slurm", "slurm", "batch", len(NODES))
    # More nodes than the partition has: refused at submit, naming the field; as is a pool nobody runs.
    answer = client.post("/v1/jobs", json=tiny_spec(**{**BASE, "resources.nodes": 3}))
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"][-2:] == ["resources", "nodes"], answer.text
    answer = client.post("/v1/jobs", json=tiny_spec(**{**BASE, "resources.pool": "gpu-cluster"}))
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"][-2:] == ["resources", "pool"], answer.text
    # More memory than a node has: refused at submit too, not accepted and then refused by sbatch.
    answer = client.post("/v1/jobs", json=tiny_spec(**{**BASE, "resources.memory_gb": 1000}))
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"][-2:] == ["resources", "memory_gb"], answer.text


def test_a_two_node_job_in_slurm_trains_like_one_node_with_two_processes(slurm_stack, browser):
    cluster, client = slurm_stack
    two_nodes = tiny_spec(**{**BASE, "name": "slurm-two-nodes", "resources.nodes": 2, "resources.processes_per_node": 1})
    one_node = tiny_spec(**{**BASE, "name": "slurm-one-node", "resources.nodes": 1, "resources.processes_per_node": 2})
    gang_id = client.post("/v1/jobs", json=two_nodes).json()["id"]
    single_id = client.post("/v1/jobs", json=one_node).json()["id"]  # queued in Slurm behind it: the nodes have 2 CPUs each
    gang, single = wait_for(client, gang_id, FINAL, timeout=300), wait_for(client, single_id, FINAL, timeout=300)
    assert gang["status"] == "succeeded", gang
    assert single["status"] == "succeeded", single

    # Slurm placed the gang: one attempt per node, both in the same Slurm job, which ended COMPLETED.
    attempts = sorted(gang["attempts"], key=lambda a: a["node_rank"])
    assert [(a["node_rank"], a["pool"], a["status"]) for a in attempts] == [(0, "slurm", "succeeded"), (1, "slurm", "succeeded")]
    assert attempts[0]["cluster_job_id"] == attempts[1]["cluster_job_id"] is not None
    deadline = time.monotonic() + 20
    while client.get(f"/v1/jobs/{gang_id}").json()["attempts"][0]["cluster_state"] != "COMPLETED":
        assert time.monotonic() < deadline, client.get(f"/v1/jobs/{gang_id}").json()["attempts"]
        time.sleep(0.5)

    # The CLI and the page say which Slurm job ran it and what Slurm says of it.
    shown = f"slurm job {attempts[0]['cluster_job_id']}: COMPLETED"
    token = client.headers["Authorization"].split()[1]
    status = subprocess.run(
        [sys.executable, "-m", "trainyard", "--server", str(client.base_url), "--token", token, "status", str(gang_id)],
        capture_output=True, text=True, timeout=60,
    )
    assert status.returncode == 0 and status.stdout.count(shown) == 2, status.stdout + status.stderr
    page = browser.new_page()
    page.goto(f"{client.base_url}/dashboard")
    page.evaluate(f"localStorage.setItem('trainyard-token', {json.dumps(token)})")
    page.goto(f"{client.base_url}/dashboard#/jobs/{gang_id}")
    page.locator("td", has_text=shown).first.wait_for(timeout=30_000)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "slurm-job.png"), full_page=True)
    assert page.locator("td", has_text=shown).count() == 2

    # Same samples, same world size: the same losses and weights; checkpoints listed as for any job.
    assert_trained_alike(client, gang_id, single_id, STEPS)
    assert [c["step"] for c in client.get(f"/v1/jobs/{gang_id}/checkpoints").json()] == [5, 10, 15, 20, 25, 30]


def test_cancelling_a_running_slurm_job_ends_its_slurm_job_within_seconds(slurm_stack):
    cluster, client = slurm_stack
    spec = tiny_spec(**{**BASE, "name": "slurm-cancel", "training.max_steps": 100_000, "checkpoint.every_steps": 100_000})
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


def test_a_slurm_job_cancelled_outside_trainyard_uses_a_restart_and_is_not_resubmitted_past_them(slurm_stack):
    """An admin's `scancel` is not a preemption: with no restart left the job fails, saying so, where it
    used to be queued and handed to Slurm again after every cancel."""
    cluster, client = slurm_stack
    spec = tiny_spec(**{**BASE, "name": "slurm-scancel", "training.max_steps": 100_000, "checkpoint.every_steps": 100_000, "max_restarts": 0})
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    wait_for_step(client, job_id, 3)
    [attempt] = client.get(f"/v1/jobs/{job_id}").json()["attempts"]
    cluster.run("scancel", attempt["cluster_job_id"])
    job = wait_for(client, job_id, FINAL, timeout=60)
    assert job["status"] == "failed" and "cancelled in Slurm (scancel)" in job["failure_reason"], job
    [attempt] = job["attempts"]  # its only one: not handed to Slurm again
    assert attempt["status"] == "failed" and "cancelled in Slurm (scancel), not by Trainyard" in attempt["failure_reason"], attempt
    assert client.get(f"/v1/jobs/{job_id}/checkpoints").json()  # it stopped at a checkpoint, to resume from if run again


def test_preempted_by_slurm_a_job_checkpoints_and_resumes_to_the_same_weights(slurm_stack, tmp_path):
    cluster, client = slurm_stack
    steps = 2000  # a few seconds: Slurm preempts it within a second of its 10th step
    spec = {**BASE, "training.max_steps": steps, "training.eval_every": 2000, "checkpoint.every_steps": 10_000}
    reference_id = client.post("/v1/jobs", json=tiny_spec(**spec, name="slurm-straight")).json()["id"]
    assert wait_for(client, reference_id, FINAL, timeout=300)["status"] == "succeeded"

    job_id = client.post("/v1/jobs", json=tiny_spec(**spec, name="slurm-preempted")).json()["id"]
    wait_for_step(client, job_id, 10)
    # A higher-priority partition's job wants both nodes' CPUs: Slurm preempts ours (SIGTERM, grace time).
    urgent = cluster.run("sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--ntasks-per-node=2", f"--output={tmp_path}/urgent.out", "--wrap=sleep 8").strip()
    job = wait_for(client, job_id, FINAL, timeout=300)
    assert job["status"] == "succeeded", job
    first, second = sorted(job["attempts"], key=lambda a: a["number"])
    assert first["status"] == "preempted" and second["status"] == "succeeded" and job["restarts"] == 0
    assert 10 <= second["resumed_from_step"] < steps  # from the checkpoint taken as it was preempted
    assert first["cluster_job_id"] != second["cluster_job_id"]
    assert urgent not in slurm_jobs(cluster)
    # Slurm never ran the preempted try again: only Trainyard's second try trained after it.
    steps_seen = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss"}).json()["series"]["train_loss"]["steps"]
    assert steps_seen == list(range(1, steps + 1))
    reference, preempted = final_weights(client, reference_id), final_weights(client, job_id)
    for name in reference:
        torch.testing.assert_close(preempted[name], reference[name], rtol=1e-5, atol=1e-6)


def test_an_agent_killed_on_a_node_loses_the_attempt_and_the_job_resumes_from_its_checkpoint(slurm_stack):
    cluster, client = slurm_stack
    # Long enough to be killed mid-run on a loaded machine (40 steps were all trained, and their last
    # checkpoint registered, by the time the first checkpoint was seen): killed once one is registered.
    steps, every = 4000, 100
    spec = tiny_spec(**{**BASE, "name": "slurm-kill-9", "training.max_steps": steps, "training.eval_every": 2000, "checkpoint.every_steps": every, "max_restarts": 2})
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    deadline = time.monotonic() + 120
    while not (saved := client.get(f"/v1/jobs/{job_id}/checkpoints").json()):  # on a busy machine, registered a little later
        assert time.monotonic() < deadline, "no checkpoint registered"
        time.sleep(0.2)
    [attempt] = client.get(f"/v1/jobs/{job_id}").json()["attempts"]
    agents = subprocess.run(["pgrep", "-f", f"slurm-agent --attempts {attempt['id']}"], capture_output=True, text=True).stdout.split()
    assert agents, "no agent process found"
    for pid in agents:
        os.kill(int(pid), signal.SIGKILL)
    job = wait_for(client, job_id, FINAL, timeout=300)
    assert job["status"] == "succeeded", job
    first, second = sorted(job["attempts"], key=lambda a: a["number"])
    assert first["status"] == "lost" and "Slurm job" in first["failure_reason"], first
    # From the newest checkpoint the service had when the node died (one being taken in may not count yet).
    assert second["resumed_from_step"] in range(max(c["step"] for c in saved), steps, every) and job["restarts"] == 1
    steps_seen = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss"}).json()["series"]["train_loss"]["steps"]
    assert steps_seen == list(range(1, steps + 1))  # each step once: a step trained again overwrote its own row
