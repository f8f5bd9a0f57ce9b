"""Attempts started from a worker's warm interpreters (workers/warm_pool.py, workers/warm.py) train
exactly as cold starts do, on one process and on two (forked ranks meeting over gloo), under the
spec's memory limit. (The sandbox's tests, tests/e2e/test_sandbox.py, run their custom-loop probe
from a warm interpreter too: every stack's worker keeps one by default.)"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from stack.embedded import StackInfo, embedded_stack
from tests.e2e.test_end_to_end import wait_for
from tests.e2e.test_faults import final_weights
from tests.helpers import tiny_spec
from workers.launch import attempt_dir
from workers.limits import available
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(600)

ONE = tiny_spec(**{"training.max_steps": 8, "checkpoint.every_steps": 8, "training.eval_every": 4})
TWO = tiny_spec(**{"training.max_steps": 8, "checkpoint.every_steps": 8, "training.eval_every": 4, "resources.processes_per_node": 2})


def run_all(info: StackInfo) -> tuple[list[tuple[dict, dict, bool]], list[dict]]:
    """Each spec run on the stack: (job, final weights, whether its attempt started warm) each, and
    the two-process job's log lines."""
    results = []
    with httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30) as client:
        for spec in (ONE, TWO):
            job = wait_for(client, client.post("/v1/jobs", json=spec).json()["id"], {"succeeded", "failed", "cancelled"})
            assert job["status"] == "succeeded", job["failure_reason"]
            started_warm = attempt_dir(info.data_dir / "work", job["id"], 1).is_symlink()  # to the interpreter's slot
            results.append((job, final_weights(client, job["id"]), started_warm))
        logs = client.get(f"/v1/jobs/{results[1][0]['id']}/logs", params={"tail": 200}).json()["lines"]  # the two-process job's
    return results, logs


def test_warm_starts_train_bit_for_bit_as_cold_ones_on_one_and_two_processes(tmp_path):
    # A stack whose worker keeps a warm interpreter and one whose worker keeps none, their jobs run
    # side by side (a stack mostly waits on its processes): the weights can't depend on it.
    with contextlib.ExitStack() as stacks, ThreadPoolExecutor(2) as pool:
        warm_stack, cold_stack = (
            stacks.enter_context(embedded_stack(tmp_path / name, free_port(), workers=1, devices="cpu:2",
                                                worker_settings={"TRAINYARD_WARM_INTERPRETERS": str(int(name == "warm"))}))
            for name in ("warm", "cold")
        )
        warm_run, cold_run = pool.submit(run_all, warm_stack), pool.submit(run_all, cold_stack)
        (warm, warm_logs), (cold, cold_logs) = warm_run.result(), cold_run.result()

    assert [started_warm for *_, started_warm in warm] == [True, True]
    assert [started_warm for *_, started_warm in cold] == [False, False]
    for (warm_job, warm_weights, _), (cold_job, cold_weights, _) in zip(warm, cold):
        assert warm_job["step"] == cold_job["step"] == 8
        assert warm_weights.keys() == cold_weights.keys()
        assert all(torch.equal(warm_weights[name], cold_weights[name]) for name in cold_weights)
    # Each rank's lines are told apart as torchrun's prefixes tell a cold start's (rank 1 of the
    # built-in loop prints nothing of its own since the sandbox's c10d warning is gone: the same ranks, not {0, 1}).
    assert {line["rank"] for line in warm_logs} == {line["rank"] for line in cold_logs} and 0 in {line["rank"] for line in cold_logs}
    assert all(any("step 8" in line["line"] and line["rank"] == 0 for line in logs) for logs in (warm_logs, cold_logs))


def test_a_warm_start_holds_the_specs_memory_limit(tmp_path, monkeypatch):
    if available() is None:
        pytest.skip("no writable cgroup here: a job with a memory limit starts cold")  # never in CI: the worker's cgroup is writable
    monkeypatch.setenv("TRAINYARD_WARM_INTERPRETERS", "1")
    data_dir = tmp_path / "yard"
    with embedded_stack(data_dir, free_port(), workers=1, devices="cpu:2") as info:
        client = httpx.Client(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}, timeout=30)
        # Far more steps than it trains before the cancel below on any machine (400 once finished first).
        spec = tiny_spec(**{"training.max_steps": 1_000_000, "checkpoint.every_steps": 1_000_000, "resources.memory_gb": 1.5})
        job_id = client.post("/v1/jobs", json=spec).json()["id"]
        run_dir = attempt_dir(data_dir / "work", job_id, 1)
        deadline = time.monotonic() + 120
        while not (run_dir / "events.jsonl").exists():
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.1)
        assert run_dir.is_symlink()
        # The interpreter's cgroup, made before the job was known, now caps it at the spec's limit.
        [training] = [p for p in psutil.process_iter(["cmdline"]) if f"{run_dir.resolve()}/" in " ".join(p.info["cmdline"] or [])
                      and (p.info["cmdline"] or [""])[0].endswith("python")]
        limit = memory_limit(training.pid)
        assert limit == int(1.5 * 2**30), limit
        client.post(f"/v1/jobs/{job_id}/cancel")
        assert wait_for(client, job_id, {"succeeded", "failed", "cancelled"})["status"] == "cancelled"
        client.close()


def memory_limit(pid: int) -> int:
    """The memory limit of the cgroup `pid` is in (v2's memory.max, v1's memory.limit_in_bytes)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            return int(Path("/sys/fs/cgroup", path.lstrip("/"), "memory.max").read_text())
        if "memory" in controllers.split(","):
            return int(Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.limit_in_bytes").read_text())
    raise AssertionError(f"process {pid} is in no memory cgroup")
