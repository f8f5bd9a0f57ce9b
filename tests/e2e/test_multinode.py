"""A 2-node job across two worker hosts of the running stack (separate worker processes, each its
own host, meeting over gloo at node 0's address): a cancel stops every rank of it on every host, and preempting one of its nodes stops both at one
checkpoint and resumes them there; each attempt of a gang has a network of its own, which reaches
its gang and nothing else: not another gang on the same hosts, nor the hosts and their services
(workers/gang_network.py). That a 2-node job trains like 1 node × 2 processes is
tests/e2e/test_multihost_netns.py's, across hosts in network namespaces of their own."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import time
from pathlib import Path

import httpx
import psutil
import pytest

from stack.embedded import embedded_stack
from tests.e2e.test_end_to_end import wait_for, wait_for_step
from tests.e2e.test_faults import FAULT_SPEC, final_weights, stack_pids_matching, wait_until_training
from tests.e2e.test_scripts import upload_code
from tests.helpers import small_spec, tiny_spec
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)


def test_cancelling_a_two_node_job_stops_every_rank_on_both_hosts_within_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")  # how often a worker looks at its lease (5 s in production)
    monkeypatch.setenv("TRAINYARD_WARM_INTERPRETERS", "0")  # a gang starts cold: warm ones would load torch for nothing
    spec = tiny_spec(**{"training.max_steps": 100_000, "checkpoint.every_steps": 100_000,
                        "resources.nodes": 2, "resources.processes_per_node": 2})
    with embedded_stack(tmp_path / "yard", free_port(), workers=2, devices="cpu:2") as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            job_id = client.post("/v1/jobs", json=spec).json()["id"]
            wait_for_step(client, job_id, 3)
            # Each node's launcher and its two ranks: their command lines name the attempt's run dir.
            processes = stack_pids_matching(f"/job-{job_id}/attempt-")
            ranks = [pid for pid in processes if "workers.training" in " ".join(psutil.Process(pid).cmdline())]
            assert len(ranks) >= 4, ranks

            asked = time.monotonic()
            assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
            job = wait_for(client, job_id, {"cancelled", "failed", "succeeded"}, timeout=60)
            while alive(processes) and time.monotonic() < asked + 30:  # a node stops its ranks at its next lease renewal
                time.sleep(0.1)
            took = time.monotonic() - asked
            assert job["status"] == "cancelled" and [a["status"] for a in job["attempts"]] == ["cancelled", "cancelled"], [(a["status"], a["failure_reason"]) for a in job["attempts"]]
            assert {a["node_rank"] for a in job["attempts"]} == {0, 1}
            assert not alive(processes)
            assert took < 20, f"cancel took {took:.1f} s"
            workers = client.get("/v1/workers").json()
            assert len(workers) == 2 and all(w["busy_slots"] == 0 and not w["attempts"] for w in workers)
            print(f"cancel → every rank of 2 nodes × 2 processes stopped and the job cancelled: {took:.1f} s")


def test_a_preemptible_gang_makes_way_on_one_host_stops_on_both_and_resumes_with_every_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")  # how often a worker looks at its lease (5 s in production)
    steps = FAULT_SPEC["training"]["max_steps"]  # a checkpoint every 25: preempted after the first, resumed from its own at the stop
    gang_spec = {**FAULT_SPEC, "name": "spot-gang", "preemptible": True, "resources": {"nodes": 2, "processes_per_node": 1}}
    urgent_spec = small_spec(**{"name": "urgent", "priority": 10, "training.max_steps": 20, "schedule.warmup_steps": 2})
    # Two one-slot hosts: the gang holds both, and the urgent job needs one of them.
    with embedded_stack(tmp_path / "yard", free_port(), workers=2, devices="cpu:1") as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            gang_id = client.post("/v1/jobs", json=gang_spec).json()["id"]
            wait_until_training(client, gang_id)
            urgent_id = client.post("/v1/jobs", json=urgent_spec).json()["id"]

            urgent = wait_for(client, urgent_id, {"succeeded", "failed", "cancelled"}, timeout=240)
            assert urgent["status"] == "succeeded", urgent["failure_reason"]
            gang = wait_for(client, gang_id, {"succeeded", "failed", "cancelled"}, timeout=300)
            assert gang["status"] == "succeeded", gang["failure_reason"]
            first = [a for a in gang["attempts"] if a["number"] == 1]
            second = [a for a in gang["attempts"] if a["number"] == 2]
            # Asked of one node, the stop was voted by every rank: both nodes stopped, both preempted, no restart used.
            assert [a["status"] for a in first] == ["preempted", "preempted"], [(a["status"], a["failure_reason"]) for a in first]
            assert any("higher-priority" in a["failure_reason"] for a in first) and gang["restarts"] == 0
            assert [a["status"] for a in second] == ["succeeded", "succeeded"]
            # Both nodes resumed from the one checkpoint they stopped at, after the urgent job ran on the host it got.
            [resumed] = {a["resumed_from_step"] for a in second}
            assert 0 < resumed < steps
            assert max(a["finished_at"] for a in first) <= urgent["attempts"][0]["started_at"]
            assert urgent["finished_at"] <= min(a["started_at"] for a in second)
            series = client.get(f"/v1/jobs/{gang_id}/metrics", params={"names": "train_loss"}).json()["series"]
            assert series["train_loss"]["steps"] == list(range(1, steps + 1))  # every step once: none lost, none twice
            assert final_weights(client, gang_id)  # the last checkpoint downloads and verifies


@pytest.mark.parametrize("frozen_host", ["local-0", "local-1"])  # where node 0, then node 1, is placed
def test_a_gang_placed_on_a_host_that_stopped_gives_both_hosts_back_and_runs_once_it_returns(tmp_path, monkeypatch, frozen_host):
    # Seconds, not the production half-minutes, for a silent host to count as gone.
    for name, value in {"HEARTBEAT_SECONDS": "0.5", "LEASE_SECONDS": "4", "HOST_TIMEOUT_SECONDS": "4", "DISPATCH_TIMEOUT_SECONDS": "6"}.items():
        monkeypatch.setenv(f"TRAINYARD_{name}", value)
    monkeypatch.setenv("TRAINYARD_WARM_INTERPRETERS", "0")  # a gang starts cold: warm ones would load torch for nothing
    steps = 20
    spec = tiny_spec(**{"training.max_steps": steps, "checkpoint.every_steps": 10, "resources.nodes": 2, "max_restarts": 2})
    with embedded_stack(tmp_path / "yard", free_port(), workers=2, devices="cpu:1") as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            # A host freezes (hung) while its last heartbeat is still fresh: the scheduler places one
            # node of the gang there, and that node never starts; the other waits for it.
            frozen = stack_pids_matching(f"worker --host-name {frozen_host}")
            freeze_outside_a_write(frozen, info.data_dir)
            try:
                job_id = client.post("/v1/jobs", json=spec).json()["id"]
                deadline = time.monotonic() + 60
                while True:
                    job = client.get(f"/v1/jobs/{job_id}").json()
                    if len(job["attempts"]) == 2 and all(a["finished_at"] for a in job["attempts"]):
                        break
                    assert time.monotonic() < deadline, f"the stranded gang was never given back: {job}"
                    time.sleep(0.3)
                # Both nodes of that try ended, the live host is free again, and the job waits for two hosts.
                assert {a["status"] for a in job["attempts"]} <= {"lost", "failed"}, job["attempts"]
                assert job["status"] == "queued" and job["restarts"] == 0  # a node that never started used no restart
                live = next(w for w in client.get("/v1/workers").json() if w["name"] != frozen_host)
                assert live["busy_slots"] == 0
                # The node that did start (and waited for its peer in the rendezvous) is stopped too.
                while alive(stack_pids_matching(f"/job-{job_id}/attempt-1")):
                    assert time.monotonic() < deadline + 30, "the first try's processes were left running"
                    time.sleep(0.3)
            finally:
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)

            job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=240)
            assert job["status"] == "succeeded", job["failure_reason"]
            second_try = [a for a in job["attempts"] if a["number"] == 2]
            assert sorted(a["host_name"] for a in second_try) == ["local-0", "local-1"] and {a["status"] for a in second_try} == {"succeeded"}
            series = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss"}).json()["series"]
            assert series["train_loss"]["steps"] == list(range(1, steps + 1))


def freeze_outside_a_write(pids: list[int], data_dir: Path, tries: int = 50) -> None:
    """SIGSTOP `pids` at a moment when none of them holds a lock on the embedded stack's SQLite
    files. A process frozen inside a transaction would keep every other writer of that file waiting
    (the API's submit timed out so in CI): that is SQLite's single writer, not the host going
    silent that these tests are about. So: stop, check that the files can be locked, else resume
    and try again."""
    for _ in range(tries):
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        if all(_lockable(data_dir / name) for name in ("trainyard.db", "broker.db")):
            return
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError(f"{pids} held a database lock at each of {tries} tries")


def _lockable(database: Path) -> bool:
    """Whether an exclusive lock on the SQLite file can be taken within a moment (live processes
    hold theirs for milliseconds)."""
    connection = sqlite3.connect(database, timeout=0.5, isolation_level=None)
    try:
        connection.execute("BEGIN EXCLUSIVE")
        connection.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        connection.close()


def alive(pids: list[int]) -> list[int]:
    """The processes of `pids` still running (not ended, not zombies awaiting their parent)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


GANG_PROBE = '''
import json, os, socket, sys, threading, time
args = json.loads(sys.argv[1])
rank, node_0 = os.environ["RANK"], os.environ["MASTER_ADDR"]
if rank == "0":  # node 0 listens on its own address, and says where
    server = socket.socket()
    server.bind(("0.0.0.0", args["listen"]))
    server.listen(16)
    print(f"LISTENING {node_0}:{args['listen']}", flush=True)
printing = threading.Lock()  # the probes' threads print at once: two print() calls can interleave on one line
def say(line):
    with printing:
        print(line, flush=True)
def probe(name, host, port):
    deadline = time.monotonic() + (20 if name == "its own node 0" else 0)  # node 0 may not listen yet
    while True:
        try:
            with socket.create_connection((host, port), timeout=3) as connection:
                connection.sendall(f"rank{rank}".encode())
            say(f"REACHED {name} from rank {rank}")
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                say(f"BLOCKED {name} from rank {rank}: {exc}")
                return
            time.sleep(0.2)
targets = {**{name: tuple(address) for name, address in args["targets"].items()}, "its own node 0": (node_0, args["listen"])}
tries = [threading.Thread(target=probe, args=(name, *address)) for name, address in targets.items()]  # at once: a drop costs a timeout
for thread in tries:
    thread.start()
for thread in tries:
    thread.join()
if rank == "0":  # until rank 1 has reached it; with `hold`, until the test says stop (another gang probes it meanwhile)
    server.settimeout(120)
    while (said := server.accept()[0].recv(5)) != b"stop" and (args.get("hold") or said != b"rank1"):
        pass
'''


def own_address() -> str:
    """This machine's address on its default route: where its services listen beside loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))
        return probe.getsockname()[0]


def probes(client: httpx.Client, job_id: int) -> set[str]:
    lines = [line["line"] for line in client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 1000}).json()["lines"]]
    return {line.partition(":")[0] for line in lines if line.startswith(("REACHED", "BLOCKED"))}


def test_a_gangs_processes_reach_their_own_gang_only_not_another_gang_nor_the_control_plane(tmp_path, postgres_url, redis_url):
    # Each attempt of a gang has a network of its own (workers/gang_network.py). Before, a gang kept
    # its hosts' network: its processes logged in to PostgreSQL as superuser and shut both workers
    # down through Redis, and could reach any other gang's ports on the same hosts.
    script = tmp_path / "gang_probe.py"
    script.write_text(GANG_PROBE)
    host = own_address()
    with socket.socket() as on_the_host:  # a port of no service, on every address of this machine
        on_the_host.bind(("0.0.0.0", 0))
        on_the_host.listen(8)
        with embedded_stack(tmp_path / "yard", free_port(), workers=2, devices="cpu:2", database_url=postgres_url, broker_url=redis_url) as info:
            with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
                bundle = upload_code(client, script)
                api = int(info.url.rpartition(":")[2])
                services = {"PostgreSQL": [host, 5432], "Redis": [host, 6379], "the API": [host, api], "a port of the host": [host, on_the_host.getsockname()[1]]}

                def gang(name: str, probe: dict) -> int:
                    spec = {"name": name, "resources": {"nodes": 2}, "max_restarts": 0,
                            "script": {"entrypoint": script.name, "args": [json.dumps(probe)], "code": {"upload_id": bundle}}}
                    return client.post("/v1/jobs", json=spec).json()["id"]

                # Gang A listens at node 0 and holds; gang B, on the same two hosts at once, tries it.
                first = gang("gang-a", {"listen": 29411, "targets": services, "hold": True})
                deadline = time.monotonic() + 120
                while not (said := [line["line"] for line in client.get(f"/v1/jobs/{first}/logs").json()["lines"] if line["line"].startswith("LISTENING")]):
                    assert time.monotonic() < deadline and client.get(f"/v1/jobs/{first}").json()["status"] in ("queued", "scheduled", "running")
                    time.sleep(0.5)
                address, _, port = said[0].split()[1].rpartition(":")
                assert address != host and not address.startswith("127.")  # its own address, not its host's
                second = wait_for(client, gang("gang-b", {"listen": 29412, "targets": {**services, "the other gang's node 0": [address, int(port)]}}),
                                  {"succeeded", "failed", "cancelled"})
                with socket.create_connection((address, int(port)), timeout=5) as stop:  # the host reaches it: its worker is trusted
                    stop.sendall(b"stop")
                first = wait_for(client, first, {"succeeded", "failed", "cancelled"})
                assert first["status"] == second["status"] == "succeeded", (first["failure_reason"], second["failure_reason"])

                blocked = {f"BLOCKED {name} from rank {rank}" for name in services for rank in "01"}
                assert probes(client, first["id"]) == blocked | {f"REACHED its own node 0 from rank {rank}" for rank in "01"}
                assert probes(client, second["id"]) == blocked | {f"REACHED its own node 0 from rank {rank}" for rank in "01"} | {
                    f"BLOCKED the other gang's node 0 from rank {rank}" for rank in "01"}
                assert all("reaching their gang only" in worker["sandbox"] for worker in client.get("/v1/workers").json())
                # The workers speak to the service over its API only: no database URL in their
                # environment, no connection of theirs in PostgreSQL's own list (before, one each idle).
                workers = [psutil.Process(pid) for pid in stack_pids_matching("trainyard worker")]
                assert len(workers) == 2 and not any("TRAINYARD_DATABASE_URL" in w.environ() for w in workers)
                assert not database_connections_of(workers, postgres_url)


def database_connections_of(processes: list[psutil.Process], postgres_url: str) -> list[int]:
    """The client ports of PostgreSQL's connections that `processes` or their children hold."""
    from sqlalchemy import create_engine, text

    ports = {c.laddr.port for p in processes for q in [p, *p.children(recursive=True)] for c in q.net_connections(kind="tcp")}
    engine = create_engine(postgres_url)
    with engine.connect() as connection:
        clients = set(connection.execute(text("SELECT client_port FROM pg_stat_activity WHERE client_port IS NOT NULL")).scalars())
    engine.dispose()
    return sorted(ports & clients)
