"""A 2-node job across two worker hosts in separate network namespaces (each its own address; the
only way between them is the bridge) trains like the same job as 1 node × 2 processes; its attempts,
each in a network of its own routed between the hosts, reach each other and nothing else."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy import select

from service.db.models import Attempt
from service.db.session import session_factory
from common.settings import Settings
from stack.embedded import embedded_stack, host_cores, stop_children, wait_for_workers, wait_healthy
from tests.conftest import IN_CI
from tests.e2e.netns import can_make_namespaces, namespaced_hosts, start_worker
from tests.e2e.test_end_to_end import wait_for, wait_for_checkpoint
from tests.e2e.test_faults import assert_same_run, assert_trained_alike, run_reference, training_ranks
from tests.e2e.test_multinode import GANG_PROBE, probes
from tests.e2e.test_scripts import upload_code
from tests.helpers import tiny_spec
from workers.launch import attempt_dir
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)

STEPS = 20


@pytest.fixture
def two_hosts(tmp_path, monkeypatch):
    """(API client, the two hosts, the stack's data dir) with the API and scheduler on this machine's own network."""
    if reason := can_make_namespaces():
        pytest.fail(f"CI=true: {reason}", pytrace=False) if IN_CI else pytest.skip(reason)
    # Checkpoints are registered (and seen by the test) within half a second, not the production 5 s.
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
    with namespaced_hosts(2) as hosts, embedded_stack(tmp_path / "yard", free_port(), workers=0) as info:
        env = {**os.environ, "TRAINYARD_DATA_DIR": str(info.data_dir)}
        # A second API process where the namespaces reach this machine (the stack's listens on
        # loopback only), as a cluster's hosts reach the service's address; each host its own token.
        port = free_port()
        with open(tmp_path / "workers.log", "ab") as log:
            api = subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--host", hosts[0].gateway, "--port", str(port)],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
            wait_healthy(f"http://{hosts[0].gateway}:{port}", [api])
            workers = [
                start_worker(host, name, "cpu:2", {**env, "TRAINYARD_API_URL": f"http://{host.gateway}:{port}", "TRAINYARD_HOST_TOKEN": host_token(name, env)}, log)
                for name, host in ((f"ns-{i}", host) for i, host in enumerate(hosts))
            ]
        for worker, cores in zip(workers, host_cores(len(workers))):  # a core each, as machines of their own
            os.sched_setaffinity(worker.pid, cores)
        wait_for_workers(info.url, info.token, ["ns-0", "ns-1"], [*workers, api], tmp_path)
        try:
            with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
                yield client, hosts, info.data_dir, (hosts[0].gateway, port)
        finally:
            stop_children([*workers, api])


def host_token(name: str, env: dict[str, str]) -> str:
    """A token for host `name`, as an admin makes one: `trainyard host token NAME`."""
    made = subprocess.run([sys.executable, "-m", "trainyard", "host", "token", name], env=env, capture_output=True, text=True, check=True)
    return made.stdout.strip()


def test_a_two_node_job_across_network_namespaces_trains_like_one_node_with_two_processes_and_reaches_only_its_gang(two_hosts, tmp_path):
    client, hosts, data_dir, api = two_hosts
    base = {"training.max_steps": STEPS, "training.eval_every": 10, "checkpoint.every_steps": 10, "checkpoint.keep_last": 1}
    two_nodes = tiny_spec(**{**base, "name": "two-nodes", "resources.nodes": 2, "resources.processes_per_node": 1})
    one_node = tiny_spec(**{**base, "name": "one-node", "resources.nodes": 1, "resources.processes_per_node": 2})

    deadline = time.monotonic() + 60
    while len(workers := client.get("/v1/workers").json()) < 2:
        assert time.monotonic() < deadline, "the namespaced workers did not register"
        time.sleep(0.2)
    assert sorted(w["address"] for w in workers) == sorted(h.address for h in hosts)

    gang_id = client.post("/v1/jobs", json=two_nodes).json()["id"]
    gang = wait_for(client, gang_id, {"succeeded", "failed", "cancelled"})
    assert gang["status"] == "succeeded", gang["failure_reason"]
    assert sorted(a["host_name"] for a in gang["attempts"]) == ["ns-0", "ns-1"]
    assert {a["status"] for a in gang["attempts"]} == {"succeeded"} and gang["effective_batch_size"] == 8
    # The ranks met at node 0's own address in its gang network (workers/gang_network.py): from the
    # other host, only the route through node 0's host leads there.
    with session_factory(f"sqlite:///{data_dir}/trainyard.db")() as session:
        node_0 = session.scalars(select(Attempt).where(Attempt.job_id == gang_id, Attempt.node_rank == 0)).one()
        assert node_0.rendezvous.rpartition(":")[0] == node_0.net_address
        assert ipaddress.ip_address(node_0.net_address) in ipaddress.ip_network(Settings().gang_network)

    # Each line is attributed to the process that printed it (global rank), launcher lines to none.
    logs = client.get(f"/v1/jobs/{gang_id}/logs", params={"tail": 1000}).json()["lines"]
    assert {line["rank"] for line in logs} <= {0, 1, None} and any(line["rank"] == 0 for line in logs)
    assert not any(line["line"].startswith("[default") for line in logs)

    single_id = client.post("/v1/jobs", json=one_node).json()["id"]
    single = wait_for(client, single_id, {"succeeded", "failed", "cancelled"})
    assert single["status"] == "succeeded", single["failure_reason"]
    # Its two processes meet in its sandbox's loopback with nothing in their logs that reads like an error.
    single_logs = client.get(f"/v1/jobs/{single_id}/logs", params={"tail": 1000}).json()["lines"]
    assert not [line["line"] for line in single_logs if "hostname of the client socket" in line["line"]]

    # Same samples, same world size: the same losses and the same weights.
    assert_trained_alike(client, gang_id, single_id, STEPS, names=("train_loss", "eval_loss", "lr"))

    # Its processes reach each other, and nothing else: not the API where the hosts reach it, not
    # a port of the other host (tests/e2e/test_multinode.py tries another gang's and the services').
    script = tmp_path / "gang_probe.py"
    script.write_text(GANG_PROBE)
    listener = subprocess.Popen(["ip", "netns", "exec", hosts[1].namespace, sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        targets = {"the API": list(api), "a port of its other host": [hosts[1].address, 29499]}
        spec = {"name": "gang-probe", "resources": {"nodes": 2}, "max_restarts": 0,
                "script": {"entrypoint": script.name, "args": [json.dumps({"listen": 29411, "targets": targets})], "code": {"upload_id": upload_code(client, script)}}}
        probe = wait_for(client, client.post("/v1/jobs", json=spec).json()["id"], {"succeeded", "failed", "cancelled"})
        assert probe["status"] == "succeeded", probe["failure_reason"]
        assert probes(client, probe["id"]) == {f"BLOCKED {name} from rank {rank}" for name in targets for rank in "01"} | {
            f"REACHED its own node 0 from rank {rank}" for rank in "01"}
    finally:
        listener.kill()


LISTEN = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 29499)); s.listen(8); print('up', flush=True); s.accept()"


def test_a_rank_that_dies_ends_the_whole_gang_which_resumes_on_both_hosts_with_every_step_once(two_hosts):
    client, hosts, data_dir, _ = two_hosts
    steps = 240  # killed after its first checkpoint (step 40), well before its end
    spec = tiny_spec(**{
        "name": "gang", "resources.nodes": 2, "resources.processes_per_node": 1, "training.max_steps": steps,
        "training.eval_every": 80, "checkpoint.every_steps": 40, "checkpoint.keep_last": 10, "max_restarts": 1,
    })
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    wait_for_checkpoint(client, job_id, timeout=180)
    ranks = training_ranks(attempt_dir(data_dir / "work", job_id, 1, node_rank=1))
    assert ranks and client.get(f"/v1/jobs/{job_id}").json()["step"] < steps
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)

    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["failure_reason"]
    first = [a for a in job["attempts"] if a["number"] == 1]
    second = [a for a in job["attempts"] if a["number"] == 2]
    assert {a["status"] for a in first} == {"failed"} and job["restarts"] == 1  # both nodes ended, one restart used
    node_0 = next(a for a in first if a["node_rank"] == 0)
    assert "node 1 of this gang ended failed" in node_0["failure_reason"]
    assert {a["status"] for a in second} == {"succeeded"} and sorted(a["host_name"] for a in second) == ["ns-0", "ns-1"]
    assert all(a["resumed_from_step"] >= 40 for a in second)
    assert_same_run(client, job_id, run_reference(client, spec), steps)
