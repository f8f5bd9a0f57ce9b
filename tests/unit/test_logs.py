"""JSON logs carry job and attempt ids as fields a log collector can filter on."""

from __future__ import annotations

import json
import logging

from service.logs import JsonFormatter, job_fields


def test_a_json_log_line_carries_the_job_and_attempt_ids_as_fields():
    record = logging.LogRecord("trainyard.worker", logging.WARNING, __file__, 1, "job %s attempt %s: %s", (7, 2, "lease lost"), None)
    for name, value in job_fields(7, 31, node_rank=1).items():
        setattr(record, name, value)
    line = json.loads(JsonFormatter("worker[gpu-1]").format(record))
    assert line["message"] == "job 7 attempt 2: lease lost" and line["level"] == "WARNING" and line["role"] == "worker[gpu-1]"
    assert (line["job_id"], line["attempt_id"], line["node_rank"]) == (7, 31, 1)
    assert "host" not in line  # fields not given are left out, not null


def test_the_scheduler_logs_a_placement_with_the_job_id_as_a_field(caplog, sqlite_url, tmp_path):
    from service.db.accounts import create_user
    from service.db.hosts import register_host
    from service.db.jobs import create_job
    from service.db.session import session_factory
    from service.scheduler import schedule_pass
    from common.settings import Settings
    from tests.helpers import job_spec

    settings = Settings(data_dir=tmp_path, database_url=sqlite_url)
    with session_factory(sqlite_url)() as session:
        job = create_job(session, create_user(session, "alice")[0], job_spec())
        register_host(session, "host-a", "cpu", 1, {})
        with caplog.at_level(logging.INFO, logger="trainyard.scheduler"):
            schedule_pass(session, settings)
    [placed] = [r for r in caplog.records if "placed on" in r.getMessage()]
    assert placed.job_id == job.id and placed.host == "host-a" and placed.attempt_id is not None


def test_a_log_line_is_attributed_to_the_process_that_printed_it():
    from tests.helpers import job_spec
    from workers.supervisor import split_rank

    gang = job_spec(**{"resources.nodes": 2, "resources.processes_per_node": 4})
    assert split_rank("[default3]:step 10: loss 2.1", node_rank=1, spec=gang) == (7, "step 10: loss 2.1")
    assert split_rank("W1123 torchrun: some launcher warning", node_rank=1, spec=gang) == (None, "W1123 torchrun: some launcher warning")
    assert split_rank("[default0]:x", node_rank=0, spec=job_spec()) == (0, "[default0]:x")  # one process: no prefix to strip
