"""A job that floods its output, on PostgreSQL + Redis (where the floods broke things): 20,000
lines printed at once (past 11,000 they broke a single INSERT) and 60,000 metric points between two
syncs are all stored, a line with a
NUL in it too; the lease stays on time; the worker goes on to the next user's job. Before,
the lines went into one INSERT past PostgreSQL's 65,535 parameters, retried for ever (the job lost,
the worker wedged), and a million points delayed the lease past its end."""

from __future__ import annotations

import textwrap

import httpx
import pytest
from sqlalchemy import func, select

from service.db.models import LogLine, Metric
from service.db.session import read_session_factory
from stack.embedded import embedded_stack
from tests.e2e.test_end_to_end import wait_for
from tests.e2e.test_scripts import upload_code
from tests.helpers import tiny_spec
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)

# bench/hostile.py floods with 100,000 lines and 1,000,000 points, and measures the lease's delays.
LINES, POINTS, NAMES = 20_000, 60_000, 10

FLOOD = textwrap.dedent(f'''
    import json, os
    for i in range({LINES}):
        print(f"line {{i}} " + "x" * 60)
    print("a NUL \\0 in a line")
    with open(os.environ["TRAINYARD_EVENTS_FILE"], "a") as events:  # the typed protocol, as accelerator.log writes it
        for step in range({POINTS // NAMES}):
            events.write(json.dumps({{"type": "metrics", "step": step, "values": {{f"m{{k}}": step + k for k in range({NAMES})}}}}) + "\\n")
    print("done")
''')


def test_a_flood_of_lines_and_points_is_all_stored_the_lease_kept_and_the_worker_goes_on(tmp_path, postgres_url, redis_url):
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    yard = tmp_path / "yard"
    with embedded_stack(yard, free_port(), workers=1, devices="cpu:2", database_url=postgres_url, broker_url=redis_url) as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            spec = {"name": "flood", "script": {"entrypoint": "flood.py", "code": {"upload_id": upload_code(client, script)}},
                    "max_restarts": 0}
            job = wait_for(client, client.post("/v1/jobs", json=spec).json()["id"], {"succeeded", "failed", "cancelled"}, timeout=180)
            assert job["status"] == "succeeded" and len(job["attempts"]) == 1, job
            with read_session_factory(postgres_url)() as session:
                lines = session.scalar(select(func.count()).select_from(LogLine).where(LogLine.job_id == job["id"]))
                points = session.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == job["id"]))
            assert lines >= LINES + 2 and points >= POINTS, (lines, points)  # and the worker's system samples
            tail = [line["line"] for line in client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 5}).json()["lines"]]
            assert "a NUL \ufffd in a line" in tail and tail[-1] == "done", tail
            # The worker was not wedged: the next job on it runs.
            after = client.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 3})).json()
            assert wait_for(client, after["id"], {"succeeded", "failed"})["status"] == "succeeded"
        worker_log = (yard / "logs" / "worker-0.log").read_text()
        assert "the lease was renewed" not in worker_log and "could not" not in worker_log, worker_log[-3000:]
