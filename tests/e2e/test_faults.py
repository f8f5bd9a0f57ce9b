"""Faults injected into the running stack: nothing is lost, no step is duplicated."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from stack.embedded import embedded_stack
from tests.e2e.test_end_to_end import final_weights, wait_for, wait_for_checkpoint, wait_for_event
from tests.helpers import small_spec, tiny_spec
from workers.launch import EVENTS_FILE_NAME, attempt_dir
from workers.outbox import EventTail
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(400)


@pytest.fixture
def two_host_stack(tmp_path, monkeypatch):
    # Short leases and heartbeats so a dead worker is noticed in seconds, not the production 30 s.
    monkeypatch.setenv("TRAINYARD_LEASE_SECONDS", "4")
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("TRAINYARD_HOST_TIMEOUT_SECONDS", "4")
    with embedded_stack(tmp_path / "yard", free_port(), workers=2) as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            yield client


def pids_matching(pattern: str) -> list[int]:
    """Processes anywhere on the machine whose command line contains `pattern` (an absolute path
    under this test's tmp_path, so no other stack's; orphans of a killed launcher included)."""
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found if int(pid) != os.getpid()]


def stack_pids_matching(pattern: str) -> list[int]:
    """Processes of this test's own stack (descendants of the test process) whose command line
    contains `pattern`: another stack running on the machine has workers of the same names."""
    return [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if pattern in " ".join(_cmdline(p))
    ]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # ended meanwhile
        return []


Reference = tuple[dict, dict[str, torch.Tensor]]  # an uninterrupted run's metric series and final weights
_references: dict[str, Reference] = {}


def run_reference(client: httpx.Client, spec: dict, shared_as: str | None = None, reference_id: int | None = None) -> Reference:
    """The same spec run straight through: what an interrupted job must end up identical to.
    Tests whose stacks train it alike (the same hosts, so the same threads) share one run, `shared_as`;
    `reference_id`: that run, submitted already (beside the interrupted one, on a stack with room for both)."""
    if shared_as in _references:
        return _references[shared_as]
    if reference_id is None:
        reference_id = client.post("/v1/jobs", json=spec).json()["id"]
    reference = wait_for(client, reference_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert reference["status"] == "succeeded" and {a["number"] for a in reference["attempts"]} == {1}  # one try (a gang: one attempt per node)
    series = client.get(f"/v1/jobs/{reference_id}/metrics", params={"names": "train_loss,eval_loss"}).json()["series"]
    run = (series, final_weights(client, reference_id))
    if shared_as is not None:
        _references[shared_as] = run
    return run


def assert_same_run(client: httpx.Client, job_id: int, reference: Reference, max_steps: int) -> None:
    """Every step reported exactly once, recomputed steps replaced their earlier values, and the
    final weights are the uninterrupted run's, bit for bit."""
    expected, straight = reference
    series = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss,eval_loss"}).json()["series"]
    assert series["train_loss"]["steps"] == list(range(1, max_steps + 1))
    assert series == expected
    resumed = final_weights(client, job_id)
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)


def assert_trained_alike(client: httpx.Client, job_id: int, other_id: int, max_steps: int, names: tuple[str, ...] = ("train_loss", "eval_loss")) -> None:
    """Two placements of the same samples at the same world size (2 nodes × 1 process, 1 × 2): every
    step once, the same series and final weights to float tolerance (the all-reduce sums in another order)."""
    params = {"names": ",".join(names)}
    series = client.get(f"/v1/jobs/{job_id}/metrics", params=params).json()["series"]
    other = client.get(f"/v1/jobs/{other_id}/metrics", params=params).json()["series"]
    assert series["train_loss"]["steps"] == list(range(1, max_steps + 1))
    for name in names:
        assert series[name]["steps"] == other[name]["steps"]
        assert series[name]["values"] == pytest.approx(other[name]["values"], rel=1e-5)
    weights, other_weights = final_weights(client, job_id), final_weights(client, other_id)
    assert weights.keys() == other_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], other_weights[name], rtol=1e-5, atol=1e-6)


def killed_and_resumed(job: dict, dead_host: str) -> tuple[dict, dict]:
    """The attempt that was killed and the one that finished the job. Between them there may be
    attempts placed on the dead host in the seconds before it counted as offline, given back unstarted."""
    first, *between, last = job["attempts"]
    assert all(a["host_name"] == dead_host and a["started_at"] is None and a["status"] == "lost" for a in between), between
    return first, last


# A fault lands mid-run, after the first of the job's checkpoints (7 more follow, ~0.02 s a step on a free core).
FAULT_SPEC = small_spec(
    **{"training.max_steps": 200, "training.eval_every": 50, "checkpoint.every_steps": 25, "checkpoint.keep_last": 10, "max_restarts": 2}
)
STEPS, EVERY = FAULT_SPEC["training"]["max_steps"], FAULT_SPEC["checkpoint"]["every_steps"]


def wait_until_training(client: httpx.Client, job_id: int, spec: dict = FAULT_SPEC) -> dict:
    """Until the job has a complete checkpoint and is still running."""
    wait_for_checkpoint(client, job_id, timeout=180)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "running" and job["step"] < spec["training"]["max_steps"]
    return job


def step_reached(client: httpx.Client, job_id: int, tmp_path: Path) -> int:
    """The last step the job's running attempt has written to its events file: where it is now, sooner
    than the API hears of it."""
    run_dir = attempt_dir((tmp_path / "yard").resolve() / "work", job_id, 1)
    return max(event.step for event in EventTail(run_dir / EVENTS_FILE_NAME).read() if event.type == "metrics")


def test_kill_9_of_a_worker_mid_job_resumes_elsewhere_with_every_step_once_and_identical_weights(two_host_stack, tmp_path):
    client = two_host_stack
    job_id = client.post("/v1/jobs", json=FAULT_SPEC).json()["id"]

    # Once a checkpoint exists, kill -9 the worker host running the job and its training processes.
    host = wait_until_training(client, job_id)["attempts"][0]["host_name"]
    run_dir = attempt_dir(tmp_path / "yard" / "work", job_id, 1)
    for pid in stack_pids_matching(f"worker --host-name {host}") + stack_pids_matching(attempt_pattern(run_dir)):
        os.kill(pid, signal.SIGKILL)

    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert job["status"] == "succeeded", job["failure_reason"]
    first, second = killed_and_resumed(job, host)
    assert first["status"] == "lost" and "stopped renewing its lease" in first["failure_reason"]
    assert second["host_name"] != host and second["resumed_from_step"] >= EVERY
    assert_same_run(client, job_id, run_reference(client, FAULT_SPEC, shared_as="two hosts"), STEPS)


def test_kill_9_while_a_checkpoint_is_being_written_resumes_from_the_complete_one_before_it(two_host_stack, tmp_path):
    client = two_host_stack
    job_id = client.post("/v1/jobs", json=FAULT_SPEC).json()["id"]
    host = wait_until_training(client, job_id)["attempts"][0]["host_name"]  # a complete checkpoint exists

    # A save's staging directory appears: kill the host and its training then. (Saves the training
    # finished but its worker had not yet taken in or listed die with the host: on a fast machine
    # saves come 0.3 s apart, and on a busy one the listing lags by a save or two.)
    checkpoints = attempt_dir(tmp_path / "yard" / "work", job_id, 1) / "checkpoints"
    deadline, listed, listed_at = time.monotonic() + 120, 0, 0.0
    while True:
        assert time.monotonic() < deadline, "no checkpoint was caught being written after the one before it was listed"
        if time.monotonic() - listed_at > 0.05:
            listed = max(c["step"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json())
            listed_at = time.monotonic()
        staging = [p.name for p in checkpoints.glob(".tmp-*")]
        if staging and (partial_step := int(staging[0].rsplit("-", 1)[1])) > listed:
            break
        time.sleep(0.002)
    for pid in stack_pids_matching(f"worker --host-name {host}") + stack_pids_matching(attempt_pattern(checkpoints.parent)):
        os.kill(pid, signal.SIGKILL)

    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert job["status"] == "succeeded", job["failure_reason"]
    first, second = killed_and_resumed(job, host)
    assert first["status"] == "lost" and second["host_name"] != host
    # Resumed from a complete checkpoint the API listed: the last one listed by the kill, or one
    # registered as it came (the partial one's, if it was renamed complete in the millisecond before
    # the kill and taken in: only a verified one is listed), never a partial one; the same weights
    # at the end as a run never killed (assert_same_run) say none was.
    assert listed <= second["resumed_from_step"] <= partial_step
    # Every listed checkpoint downloads whole and matches its sha256; the partial one never entered the store.
    for checkpoint in client.get(f"/v1/jobs/{job_id}/checkpoints").json():
        body = client.get(f"/v1/checkpoints/{checkpoint['id']}/download")
        assert hashlib.sha256(body.content).hexdigest() == checkpoint["sha256"] == body.headers["x-checkpoint-sha256"]
    store = tmp_path / "yard" / "artifacts" / "jobs" / str(job_id) / "checkpoints"
    assert not list(store.glob(".tmp-*"))
    assert_same_run(client, job_id, run_reference(client, FAULT_SPEC, shared_as="two hosts"), STEPS)


def test_sigterm_to_a_worker_checkpoints_requeues_and_loses_no_step(two_host_stack, tmp_path):
    client = two_host_stack
    job_id = client.post("/v1/jobs", json=FAULT_SPEC).json()["id"]
    host = wait_until_training(client, job_id)["attempts"][0]["host_name"]
    [worker] = stack_pids_matching(f"worker --host-name {host}")
    reached = step_reached(client, job_id, tmp_path)
    os.kill(worker, signal.SIGTERM)

    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert job["status"] == "succeeded", job["failure_reason"]
    first, second = job["attempts"]
    assert first["status"] == "preempted" and job["restarts"] == 0  # a preemption uses no restart
    assert second["host_name"] != host
    # It stopped at a checkpoint of its own, where it was, not at the last scheduled one before.
    assert second["resumed_from_step"] >= reached, (second["resumed_from_step"], reached)
    assert_same_run(client, job_id, run_reference(client, FAULT_SPEC, shared_as="two hosts"), STEPS)


def training_ranks(run_dir: Path) -> list[int]:
    """The attempt's training processes: not Accelerate's launcher nor the sandbox's bwrap (whose
    command lines name the same directory), nor a warm interpreter that forked them (workers/warm.py)."""
    ranks = []
    for pid in pids_matching(attempt_pattern(run_dir)):
        try:
            command, parent = open(f"/proc/{pid}/cmdline", "rb").read(), psutil.Process(pid).ppid()
        except (FileNotFoundError, psutil.Error):
            continue
        if b"accelerate.commands.launch" not in command and not command.split(b"\0")[0].endswith(b"bwrap"):
            ranks.append((pid, parent))
    forked_ranks = {parent for _, parent in ranks}
    return [pid for pid, _ in ranks if pid not in forked_ranks]


def attempt_pattern(run_dir: Path) -> str:
    """What the command lines of an attempt's processes hold: its directory, or for an attempt
    started warm the interpreter's own, which its directory links to (workers/warm_pool.py)."""
    return f"{run_dir.resolve()}/"


def signal_ranks(ranks: list[int], signum: int) -> None:
    """SIGSTOP or SIGCONT the training processes, those that are still there."""
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signum)


def test_a_hung_training_process_is_killed_after_the_stall_timeout_and_the_job_resumes_with_every_step_once(two_host_stack, tmp_path):
    client = two_host_stack
    # Tiny steps (2-50 ms). The stall timeout must cover a cold start of the training processes
    # (10-15 s on 2 busy cores).
    max_steps, stall_timeout = 1200, 30
    spec = tiny_spec(
        **{"training.max_steps": max_steps, "training.eval_every": 400, "checkpoint.every_steps": 100, "checkpoint.keep_last": 20,
           "training.stall_timeout_s": stall_timeout, "max_restarts": 2}
    )
    job_id = client.post("/v1/jobs", json=spec).json()["id"]

    # SIGSTOP: the rank hangs without dying, like a rank stuck in a collective. Its worker is
    # alive and keeps renewing the lease, so only the stall timeout can end the attempt. It hangs
    # right after its first checkpoint, read from its events file: the API learns of it later,
    # and a fast machine can have finished the job by then.
    # The full run dir, so that no other Trainyard on this machine (with its own job 1) is matched.
    first_run_dir = attempt_dir((tmp_path / "yard").resolve() / "work", job_id, 1)
    wait_for_event(EventTail(first_run_dir / EVENTS_FILE_NAME), "checkpoint", timeout=120)
    [rank] = training_ranks(first_run_dir)
    os.kill(rank, signal.SIGSTOP)
    stopped_at = datetime.now(timezone.utc)

    job = wait_for(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert job["status"] == "succeeded", job["failure_reason"]
    first, second = job["attempts"]
    assert first["status"] == "failed" and first["failure_reason"].startswith(f"stalled: no optimizer step or checkpoint for {stall_timeout} s")
    assert job["restarts"] == 1  # a stall is a failure: it uses a restart
    # Killed for the stall, once it lasted the timeout (counted from the last step before the stop).
    hung_for = (datetime.fromisoformat(first["finished_at"]) - stopped_at).total_seconds()
    assert stall_timeout - 2 <= hung_for <= stall_timeout + 30, hung_for
    assert second["status"] == "succeeded" and second["resumed_from_step"] >= 100
    assert not pids_matching(attempt_pattern(first_run_dir)), "the hung attempt's processes were left behind"
    series = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "train_loss"}).json()["series"]
    assert series["train_loss"]["steps"] == list(range(1, max_steps + 1))


@pytest.fixture
def one_slot_stack(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_LEASE_SECONDS", "4")
    monkeypatch.setenv("TRAINYARD_HEARTBEAT_SECONDS", "0.5")
    with embedded_stack(tmp_path / "yard", free_port(), workers=1, devices="cpu:1") as info:
        with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
            yield client


def test_a_preemptible_job_makes_way_for_a_higher_priority_one_and_resumes_with_no_step_lost(one_slot_stack, tmp_path):
    client = one_slot_stack
    spot_spec = {**FAULT_SPEC, "preemptible": True}
    spot_id = client.post("/v1/jobs", json=spot_spec).json()["id"]
    wait_until_training(client, spot_id)
    reached = step_reached(client, spot_id, tmp_path)
    urgent_id = client.post("/v1/jobs", json=small_spec(**{"name": "urgent", "priority": 10, "training.max_steps": 20, "schedule.warmup_steps": 2})).json()["id"]

    urgent = wait_for(client, urgent_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert urgent["status"] == "succeeded", urgent["failure_reason"]
    spot = wait_for(client, spot_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert spot["status"] == "succeeded", spot["failure_reason"]
    first, second = spot["attempts"]
    assert first["status"] == "preempted" and "higher-priority" in first["failure_reason"] and spot["restarts"] == 0
    # The urgent job ran in between, on the one slot the spot job gave back.
    assert first["finished_at"] <= urgent["attempts"][0]["started_at"] and urgent["finished_at"] <= second["started_at"]
    assert second["resumed_from_step"] >= reached  # its own checkpoint at the stop, not the last periodic one before
    assert_same_run(client, spot_id, run_reference(client, FAULT_SPEC), STEPS)
