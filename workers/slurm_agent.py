"""One node of a Slurm pool's try (service/backends/slurm.py): started by `srun`, one per node of
the allocation, it runs its node's attempt as a registered host runs one, with the same
supervisor and sandbox, speaking the worker protocol to the API with the try's token.

From Slurm's environment: which node this is (SLURM_NODEID picks its attempt from the try's, in
node order) and its name (SLURMD_NODENAME), whose address (`scontrol`'s NodeAddr) node 0 gives
the other nodes to meet at. SIGTERM (a cancel, Slurm preempting the job, its time limit) is a host
going away: the training checkpoints and stops, and the attempt is reported preempted, so the
service queues the job again and it resumes from there. But a Slurm job cancelled by someone else
(an admin's or its owner's `scancel`: see cancelled_in_slurm) was stopped on purpose: the attempt is
reported failed, so the job is tried again only while it has restarts left, instead of being
submitted again each time it is cancelled (a cancel by Trainyard ends the job cancelled either way).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from api_schemas.host_api import UNREACHABLE_FILE
from common.settings import Settings
from workers.host_client import HostClient, ServiceUnreachable, read_token
from workers.sandbox import HostSandbox
from workers.supervisor import AttemptRunner
from workers.warm_pool import WarmPool

log = logging.getLogger("trainyard.worker")


def node_address(node_name: str) -> str:
    """Where the other nodes reach this one: its NodeAddr in Slurm (which defaults to its name)."""
    try:
        out = subprocess.run(["scontrol", "--oneliner", "show", "node", node_name], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    if found := re.search(r"\bNodeAddr=(\S+)", out):
        return found.group(1)
    try:
        return socket.gethostbyname(node_name)
    except OSError:
        return "127.0.0.1"


def cancelled_in_slurm(slurm_job_id: str | None) -> str | None:
    """Why this node's Slurm job is stopping, if it was cancelled (`scancel`) rather than preempted
    or out of time; None otherwise, or if Slurm can't say. Asked while the job's processes still
    run: a preempted job is RUNNING through its GraceTime, a cancelled or timed-out one already
    COMPLETING (Slurm 22.05 shows no more), and only a timed-out one has run its whole TimeLimit."""
    if not slurm_job_id:
        return None
    try:
        out = subprocess.run(["scontrol", "--oneliner", "show", "job", slurm_job_id], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = dict(re.findall(r"\b(JobState|RunTime|TimeLimit)=(\S+)", out))
    state, ran, limit = fields.get("JobState"), slurm_seconds(fields.get("RunTime")), slurm_seconds(fields.get("TimeLimit"))
    if state == "CANCELLED" or (state == "COMPLETING" and not (ran is not None and limit is not None and ran >= limit)):
        return f"Slurm job {slurm_job_id} was cancelled in Slurm (scancel), not by Trainyard"
    return None


def slurm_seconds(text: str | None) -> int | None:
    """Slurm's `[days-]hours:minutes:seconds` (or fewer parts) in seconds; None for UNLIMITED or other words."""
    if not text or not (found := re.fullmatch(r"(?:(\d+)-)?(\d+(?::\d+){0,2})", text)):
        return None
    parts = [int(part) for part in found.group(2).split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(found.group(1) or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def run_agent(settings: Settings, attempt_ids: list[int], threads: int | None, warm: bool = False) -> int:
    """Run this node's attempt to its end; the exit status is 0 however the attempt ended (the
    service knows how), 2 if this node has none of the try's attempts or no token. `warm`: the
    attempt may start from a warm interpreter, loaded from now on, while it is claimed."""
    node = int(os.environ.get("SLURM_NODEID", "0"))
    if not 0 <= node < len(attempt_ids):
        log.error("node %s of a try of %s attempts: nothing to run here", node, len(attempt_ids))
        return 2
    token = read_token(settings.host_token, settings.host_token_file)
    if not token:
        log.error("no token: TRAINYARD_HOST_TOKEN_FILE %s is empty or gone", settings.host_token_file)
        return 2
    node_name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    service = HostClient(settings.api_url, token)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sandbox = HostSandbox.detect(unsafe=False)
    # Torch and accelerate load from now on, beside the claim and the inputs' placing, instead of after them.
    pool = WarmPool(settings, sandbox, 1) if warm else None
    if pool is not None:
        pool.fill()
    runner = AttemptRunner(settings, service, node_name, node_address(node_name), sandbox, pool, cpu_threads=threads)
    signal.signal(signal.SIGTERM, lambda *_: runner.preempt_all())
    runner.stopped_for_good = lambda: cancelled_in_slurm(os.environ.get("SLURM_JOB_ID"))
    # The API may be restarting as the allocation starts: wait for it as long as a dispatch lasts.
    deadline = time.monotonic() + settings.dispatch_timeout_seconds
    try:
        while True:
            try:
                runner.run(attempt_ids[node])
                break
            except ServiceUnreachable as exc:
                if time.monotonic() > deadline:
                    # Said where the scheduler looks (the try's directory, beside the token): the attempt is
                    # then lost and tried again, not failed as a job whose agent can't start would be.
                    if settings.host_token_file is not None:
                        (Path(settings.host_token_file).parent / UNREACHABLE_FILE).write_text(f"{settings.api_url}: {exc}\n")
                    raise
                log.warning("the service at %s is out of reach (%s); trying again", settings.api_url, exc)
                time.sleep(2)
    finally:
        if pool is not None:
            pool.close()  # one attempt per agent: an interpreter it did not use, or the replacement the runner asked for, goes
        # Its directory on the shared work root, unless it failed (kept for its owner to look into, the
        # operator's to remove): no agent lives on to remove it in ten minutes, as a host's worker does.
        runner.ended_attempts.sweep(finished_now=True)
    service.close()
    return 0
