"""Slurm over its REST API: the four things the Slurm backend asks of Slurm (slurm_commands.py) done
through `slurmrestd` with a JWT, for a scheduler that can't run Slurm's own commands (no munge key
of the cluster, not on one of its machines: the way a service outside the cluster reaches it).

The site runs slurmrestd with `-a rest_auth/jwt` (slurmctld configured `AuthAltTypes=auth/jwt`) and
gives the scheduler a token (`scontrol token username=<user> lifespan=<seconds>`) in a file,
TRAINYARD_SLURM_JWT_FILE, read again on every request: a token replaced in the file is used at the
next call, no restart. Jobs are submitted as that user. OpenAPI v0.0.38 (Slurm 22.05), the oldest
version this speaks.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx

from service.backends.slurm_commands import TRANSIENT, BatchJob, SlurmError, SlurmJob, gpus_in

API = "/slurm/v0.0.38"


class SlurmRest:
    def __init__(self, url: str, user: str, token_file: Path, working_directory: Path, timeout_seconds: float = 30.0):
        self.url, self.user, self.token_file, self.working_directory = url.rstrip("/"), user, token_file, working_directory
        self.timeout_seconds = timeout_seconds

    def submit(self, job: BatchJob) -> str:
        """The new Slurm job's id. A job Slurm takes but can't run as asked (more nodes than the
        partition has) comes with an error and an id, as sbatch takes it: pending, its Reason saying why."""
        return str(self._call("POST", "/job/submit", job.rest_submission(self.working_directory), result="job_id")["job_id"])

    def queue(self) -> dict[str, SlurmJob]:
        """Our jobs Slurm still knows, by id (the token's user's, as `squeue --me`). A job whose user
        slurmrestd could not name (its host doesn't resolve the cluster's users: `user_name` null)
        is kept too: our jobs were all taken for gone, and each try submitted again, without end."""
        jobs = self._call("GET", "/jobs", result="jobs")["jobs"]
        return {
            str(job["job_id"]): SlurmJob(str(job["job_id"]), job["name"], job["job_state"], job.get("state_reason") or "None")
            for job in jobs if job.get("user_name") in (self.user, None, "")
        }

    def cancel(self, job_id: str) -> None:
        self._call("DELETE", f"/job/{job_id}")

    def partition(self, name: str) -> dict:
        """What the partition offers: nodes, and the most CPUs, GPUs and memory one node has."""
        nodes = [node for node in self._call("GET", "/nodes", result="nodes")["nodes"] if name in node.get("partitions", [])]
        if not nodes:
            raise SlurmError(f"slurmrestd: no partition {name!r}, or it has no nodes", transient=False)
        [partition] = [p for p in self._call("GET", f"/partition/{name}", result="partitions")["partitions"] if p.get("name") == name] or [{}]
        limit = partition.get("max_time_limit")  # minutes; -1 for none
        return {
            "partition": name, "nodes": len(nodes), "cpus_per_node": max(node["cpus"] for node in nodes),
            "gpus_per_node": max(gpus_in(node.get("gres", "")) for node in nodes), "memory_mb": max(node["real_memory"] for node in nodes),
            "max_minutes": limit if isinstance(limit, int) and limit >= 0 else None,
        }

    def _call(self, method: str, path: str, body: dict | None = None, result: str | None = None) -> dict:
        """The answer; raises SlurmError for an error unless the answer also carries its `result`
        (slurmrestd reports warnings as errors beside a result: the job was submitted)."""
        token = self._token()
        headers = {"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": token}
        try:
            response = httpx.request(method, self.url + API + path, headers=headers, json=body, timeout=self.timeout_seconds)
            answer = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SlurmError(f"slurmrestd at {self.url}: {exc or type(exc).__name__}", transient=True) from exc
        errors = [error.get("description") or error.get("error") or str(error) for error in answer.get("errors", [])]
        if response.status_code >= 400 or (errors and (result is None or answer.get(result) is None)):
            message = f"slurmrestd: {'; '.join(errors) or f'HTTP {response.status_code}'}"
            if (expired := _expired_at(token)) is not None:  # slurmctld only drops the connection
                raise SlurmError(f"{message} (the token in {self.token_file} expired at {expired}: write a new one there)", transient=True)
            # slurmrestd answers 500 for a bad request too: the controller's words tell which it is, as sbatch's do.
            raise SlurmError(message, transient=response.status_code in (502, 503, 504) or any(text in message for text in TRANSIENT))
        return answer

    def _token(self) -> str:
        try:
            text = self.token_file.read_text().strip()
        except OSError as exc:
            raise SlurmError(f"TRAINYARD_SLURM_JWT_FILE {self.token_file}: {exc.strerror}", transient=True) from exc
        return text.removeprefix("SLURM_JWT=")  # as `scontrol token` prints it, or the token alone


def _expired_at(token: str) -> str | None:
    """When the JWT expired, if it has (its payload's `exp`; the signature is slurmctld's to check)."""
    try:
        payload = token.split(".")[1]
        expires = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["exp"]
    except (IndexError, ValueError, KeyError, TypeError):
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires)) if expires < time.time() else None
