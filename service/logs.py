"""Process logging: plain lines for people, or one JSON object per line for log collectors.

Log calls about a job pass `extra=job_fields(...)`, so that in JSON each line carries `job_id` and
`attempt_id` as fields to filter on, not only inside the message.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

from api_schemas.host_api import HOST_API_PREFIX

FIELDS = ("job_id", "attempt_id", "node_rank", "host", "request_id")


def job_fields(job_id: int, attempt_id: int | None = None, **more) -> dict:
    return {"job_id": job_id, "attempt_id": attempt_id, **more}


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "role": self.role,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({name: getattr(record, name) for name in FIELDS if getattr(record, name, None) is not None})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(role: str, log_format: str) -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # a dozen lines of its set-up at each start of each process


class QuietMachineTraffic(logging.Filter):
    """For uvicorn's access log: no line for a worker protocol request that succeeded. Every host
    sends one every few seconds (1,000 hosts: ~150 lines a second of routine), and writing them cost
    the API's event loop ~8% of its time under that load (py-spy); a refused one is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path, HTTP version, status)
        args = record.args if isinstance(record.args, tuple) and len(record.args) == 5 else None
        return args is None or not (str(args[2]).startswith(HOST_API_PREFIX) and isinstance(args[4], int) and args[4] < 400)
