"""PostgreSQL, Redis and the API restarted under a running job (production mode), the API down for
20 s (twice the lease) while it trains: nothing is lost, no attempt either.

The test runs its own redis-server and PostgreSQL cluster, so it can stop and start them without
touching the shared servers other tests use.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from stack.embedded import embedded_stack
from tests.conftest import service_missing
from tests.e2e.test_end_to_end import wait_for, wait_for_event, wait_for_step
from tests.e2e.test_faults import signal_ranks, training_ranks
from tests.helpers import tiny_spec
from tests.private_services import PostgresCluster, RedisServer, why_no_private_postgres, why_no_private_redis
from workers.launch import EVENTS_FILE_NAME, attempt_dir
from workers.outbox import EventTail
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def private_redis(tmp_path):
    if why_not := why_no_private_redis():
        service_missing("a private redis-server", FileNotFoundError(why_not))
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def private_postgres():
    if why_not := why_no_private_postgres():
        service_missing("a private PostgreSQL cluster", FileNotFoundError(why_not))
    cluster = PostgresCluster()
    try:
        cluster.start()
        cluster.create_database()
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture
def production_stack(tmp_path, monkeypatch, private_redis, private_postgres):
    # A lease and a host timeout of 10 s, half the API's outage (and a third of production's): an
    # outage of the API or the database longer than a lease costs no attempt, as the scheduler judges
    # no lease while no API is up, nor until one has been for a lease (service/db/api_processes.py).
    # A dispatch lost with Redis is re-sent after the dispatch timeout, shortened from the production 60 s.
    monkeypatch.setenv("TRAINYARD_LEASE_SECONDS", "10")
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("TRAINYARD_HOST_TIMEOUT_SECONDS", "10")
    monkeypatch.setenv("TRAINYARD_DISPATCH_TIMEOUT_SECONDS", "5")
    with embedded_stack(
        tmp_path / "yard", free_port(), workers=1, database_url=private_postgres.url, broker_url=private_redis.url
    ) as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            yield client, info, private_redis, private_postgres


def test_redis_postgres_and_the_api_restarted_mid_job_lose_no_step_no_checkpoint_and_strand_no_job(production_stack):
    client, stack, redis_server, postgres = production_stack
    max_steps, every = 600, 100
    spec = tiny_spec(**{"training.max_steps": max_steps, "training.eval_every": 200, "checkpoint.every_steps": every,
                        "checkpoint.keep_last": 100})
    job_id = client.post("/v1/jobs", json=spec).json()["id"]

    # Tiny steps take 2 ms on a fast idle machine and 50 on a busy one, so the job's length can't
    # be made to outlast the outages below. Instead its training process is paused (SIGSTOP) while
    # the test needs the job still running: at its first step, and again after its first
    # checkpoint, which it trains to while PostgreSQL is down. Its worker is not paused: it keeps
    # renewing the lease, and keeps what the training wrote until the database is back.
    run_dir = attempt_dir(stack.data_dir / "work", job_id, 1)
    events = EventTail(run_dir / EVENTS_FILE_NAME)
    first_step = wait_for_event(events, "metrics").step
    ranks = training_ranks(run_dir)
    assert ranks, "no training process found for the running attempt"
    signal_ranks(ranks, signal.SIGSTOP)
    try:
        wait_for_step(client, job_id, first_step)

        # Redis goes away under the running attempt, and a job is submitted meanwhile (the API needs
        # no broker): its dispatch is lost and must be re-sent once Redis is back. Then PostgreSQL
        # goes away too, and the training goes on to a checkpoint: the worker keeps the job's
        # metrics and that checkpoint until it can deliver them.
        redis_server.stop()
        second = client.post("/v1/jobs", json=tiny_spec())
        assert second.status_code == 201
        postgres.stop()
        signal_ranks(ranks, signal.SIGCONT)
        checkpoint_step = wait_for_event(events, "checkpoint").step
        signal_ranks(ranks, signal.SIGSTOP)
        assert checkpoint_step < max_steps
        postgres.start()
        redis_server.start()
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "running", f"the outages ended the job: {job}"

        # The API goes away for 20 s while the training goes on to its next checkpoint (or its
        # end): the worker, which reaches the service only through it, keeps training and keeps
        # what it can't deliver. Then a new API process serves the same jobs, and the worker catches up.
        stack.stop("api")
        down_at = time.monotonic()
        signal_ranks(ranks, signal.SIGCONT)
        assert wait_for_event(events, "checkpoint").step > checkpoint_step  # trained to while the API was down
        time.sleep(max(0.0, 20 - (time.monotonic() - down_at)))
        stack.start("api")
    finally:
        signal_ranks(ranks, signal.SIGCONT)

    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert job["status"] == "succeeded", job["failure_reason"]
    assert [a["status"] for a in job["attempts"]] == ["succeeded"]  # the outages cost no attempt
    series = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss"}).json()["series"]
    assert series["train_loss"]["steps"] == list(range(1, max_steps + 1))
    assert [c["step"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json()] == list(range(every, max_steps + 1, every))

    assert wait_for(client, second.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=120)["status"] == "succeeded"
    counts = client.get("/v1/dashboard").json()["jobs_by_status"]
    assert counts["scheduled"] == counts["queued"] == counts["running"] == 0 and counts["succeeded"] == 2
