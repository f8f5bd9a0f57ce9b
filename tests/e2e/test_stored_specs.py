"""After an upgrade, a job an earlier version stored still reads, schedules and runs: a spec field this
version no longer has (removed, or renamed) is left out of it, not refused (JobSpec.from_stored)."""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import select

from service.db.models import Job
from service.db.session import session_factory
from stack.embedded import embedded_stack
from tests.e2e.test_end_to_end import wait_for
from tests.helpers import tiny_spec
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(180)


def test_a_job_stored_with_a_field_this_version_dropped_reads_schedules_and_runs(postgres_url, tmp_path):
    with embedded_stack(tmp_path / "yard", free_port(), workers=1, database_url=postgres_url) as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            info.stop("worker-0")  # it leaves the pool: the job waits while its stored spec is made an earlier version's
            job_id = client.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 6})).json()["id"]
            with session_factory(postgres_url)() as session:
                job = session.scalar(select(Job).where(Job.id == job_id))
                job.spec = {**job.spec, "queue": "legacy", "training": {**job.spec["training"], "warmup_ratio": 0.1}}
                session.commit()

            shown = client.get(f"/v1/jobs/{job_id}")
            assert shown.status_code == 200, shown.text  # was a 500: the stored spec re-read with today's rules
            assert "queue" not in shown.json()["spec"] and "warmup_ratio" not in shown.json()["spec"]["training"]
            assert client.get("/v1/jobs").status_code == 200  # one such job would fail everyone's list

            info.start("worker-0")
            assert wait_for(client, job_id, {"succeeded", "failed", "cancelled"})["status"] == "succeeded"

            # One stored before a check of today's (a name longer than a file system takes) still
            # reads; the worker fails it saying why, at once: its lease ran out, and the job said its
            # host had gone away.
            info.stop("worker-0")
            job_id = client.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 6})).json()["id"]
            with session_factory(postgres_url)() as session:
                job = session.scalar(select(Job).where(Job.id == job_id))
                job.spec = {**job.spec, "dataset": {**job.spec["dataset"], "path": "o" * 300}}
                session.commit()
            assert client.get(f"/v1/jobs/{job_id}").status_code == 200
            info.start("worker-0")
            started = time.monotonic()
            failed = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
            assert failed["status"] == "failed" and "could not run it" in failed["failure_reason"] and "File name too long" in failed["failure_reason"], failed
            assert time.monotonic() - started < 20  # two attempts (max_restarts 1), neither waiting out its lease
