"""Following a job's logs (Client.follow_logs, `trainyard logs -f`) against the real API app."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import service.api.events
from service.api.main import create_app
from service.db.accounts import create_user
from service.db.jobs import create_job
from service.db.log_lines import record_logs
from service.db.session import session_factory
from tests.client.serve import serve_app
from tests.helpers import finish_job, job_spec, start_job
from trainyard import Client  # the import the README shows


@pytest.mark.timeout(60)
def test_following_logs_reads_every_line_once_in_order_in_bounded_pages_until_the_job_ends(settings, monkeypatch):
    monkeypatch.setattr(service.api.events, "PAGE", 3)  # small pages, so paging is exercised
    with session_factory(settings.resolved_database_url)() as session:
        user, token = create_user(session, "alice")
        job_id = create_job(session, user, job_spec(**{"resources.processes_per_node": 2})).id
    claimed = start_job(settings, job_id, slots=2)

    def write(lines: range) -> None:
        with session_factory(settings.resolved_database_url)() as session:
            record_logs(session, job_id, claimed, [(i, 0, f"line {i}") for i in lines])

    write(range(0, 5))
    with serve_app(create_app(settings)) as url, Client(url, token) as client, ThreadPoolExecutor(1) as background:
        tail_read = threading.Event()

        def follow() -> list[str]:
            lines = []
            for line in client.follow_logs(job_id, tail=2):
                lines.append(line.line)
                if len(lines) == 2:
                    tail_read.set()
            return lines

        followed = background.submit(follow)
        # The tail is taken when the client connects: the lines below must come after it.
        assert tail_read.wait(30)
        write(range(5, 12))  # more than a page while following
        write(range(5, 8))  # a re-sent batch is stored once
        time.sleep(0.3)
        write(range(12, 14))
        finish_job(settings, claimed)
        assert followed.result(timeout=30) == [f"line {i}" for i in range(3, 14)]  # the last 2, then all new ones

        page = client.logs(job_id, tail=4)
        assert [line.line for line in page.lines] == [f"line {i}" for i in range(10, 14)]
        assert client.logs(job_id, tail=4, cursor=page.next_cursor).lines == []

        with session_factory(settings.resolved_database_url)() as session:
            record_logs(session, job_id, claimed, [(100, 1, "from rank 1"), (101, None, "from the launcher")])
        assert [(line.rank, line.line) for line in client.logs(job_id, tail=10, rank=1).lines] == [(1, "from rank 1")]
        assert [line.rank for line in client.logs(job_id, tail=2).lines] == [1, None]
