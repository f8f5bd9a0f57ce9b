"""No secret reaches a log: database and broker passwords, API tokens (production backends)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from stack.embedded import embedded_stack
from tests.e2e.test_end_to_end import wait_for
from tests.helpers import tiny_spec
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(300)

DB_PASSWORD, BROKER_PASSWORD, WRONG_TOKEN = "db-pw-7f3e9a", "broker-pw-51c2d8", "not-a-token-c4a1e6"


def test_a_job_run_with_passworded_urls_leaves_no_password_or_token_in_any_log(postgres_url, redis_url, tmp_path):
    # The test servers trust every client, so these passwords are accepted and would show if logged.
    database_url = postgres_url.replace("postgres@", f"postgres:{DB_PASSWORD}@")
    broker_url = redis_url.replace("redis://", f"redis://default:{BROKER_PASSWORD}@")
    with embedded_stack(tmp_path / "yard", free_port(), workers=1, database_url=database_url, broker_url=broker_url) as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            job_id = client.post("/v1/jobs", json=tiny_spec(**{"training.max_steps": 6, "training.eval_every": 3})).json()["id"]
            assert wait_for(client, job_id, {"succeeded", "failed", "cancelled"})["status"] == "succeeded"
            assert httpx.get(f"{info.url}/v1/jobs", headers={"Authorization": f"Bearer {WRONG_TOKEN}"}).status_code == 401
            job_output = "\n".join(line["line"] for line in client.get(f"/v1/jobs/{job_id}/logs", params={"tail": 1000}).json()["lines"])
        token = info.token
    logs = {path.name: path.read_text(errors="replace") for path in Path(info.data_dir, "logs").glob("*.log")}
    logs["job output"] = job_output
    assert {"api.log", "scheduler.log", "worker-0.log"} <= set(logs) and "succeeded" in logs["worker-0.log"]
    for secret in (DB_PASSWORD, BROKER_PASSWORD, WRONG_TOKEN, token):
        leaked = [name for name, text in logs.items() if secret in text]
        assert not leaked, f"{secret!r} is in {leaked}"
