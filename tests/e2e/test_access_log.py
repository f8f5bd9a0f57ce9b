"""The API's access log: every user request, and a worker protocol request only when it was refused
(1,000 hosts' routine heartbeats and reports would be ~150 lines a second)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from api_schemas.host_api import HOST_API_PREFIX
from stack.embedded import embedded_stack
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(120)


def test_the_access_log_has_the_users_requests_and_a_refused_hosts_not_the_hosts_routine(tmp_path):
    with embedded_stack(tmp_path / "yard", free_port(), workers=1) as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            assert client.get("/v1/jobs").status_code == 200
            workers = client.get("/v1/workers").json()
        assert workers and workers[0]["online"]  # its worker registered and heartbeats: host requests that succeeded
        refused = httpx.post(f"{info.url}{HOST_API_PREFIX}/heartbeat", headers={"Authorization": "Bearer tyh_wrong"})
        assert refused.status_code == 401
    log = Path(info.data_dir, "logs", "api.log").read_text()
    access = [line for line in log.splitlines() if re.search(r'"(GET|POST|PUT|DELETE) /', line)]
    assert any('"GET /v1/jobs HTTP/1.1" 200' in line for line in access)
    assert any(f'"POST {HOST_API_PREFIX}/heartbeat HTTP/1.1" 401' in line for line in access)
    assert not [line for line in access if f" {HOST_API_PREFIX}/" in line and '" 401' not in line], access
