"""An attempt's bounds (workers/limits.py): its slots' share of the host unless its spec asks for its
own, CPU held by the kernel's quota, and the disk its directory takes as the disk counts it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import job_spec
from workers.limits import AttemptLimits, Bounds, DiskWatch, SlotShare, available, directory_bytes, limited, own_group
from workers.supervisor import AttemptRunner


def test_a_slot_is_the_hosts_cores_and_memory_divided_by_its_slots_unless_the_operator_says(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert SlotShare.of_host(4, None) == SlotShare(cores=2, memory_bytes=memory // 4)
    assert SlotShare.of_host(16, 1.5) == SlotShare(cores=1, memory_bytes=int(1.5 * 2**30))  # a core at least


def test_an_attempt_is_bounded_by_its_slots_share_unless_its_spec_asks_for_a_memory_limit():
    share = SlotShare(cores=2, memory_bytes=3 * 2**30)
    runner = SimpleNamespace(share=share, sandbox=SimpleNamespace(limits="cgroup v2"))
    assert AttemptRunner._bounds(runner, job_spec(), slots=2) == Bounds(memory_bytes=6 * 2**30, cpu_cores=4)
    asked = job_spec(**{"resources.memory_gb": 1})
    assert AttemptRunner._bounds(runner, asked, slots=2) == Bounds(memory_bytes=2**30, cpu_cores=4)
    # Without cgroups a default would be an address-space rlimit per process, which breaks healthy PyTorch
    # jobs: only what the spec asks for holds there. In a Slurm allocation (no share) Slurm bounds the job.
    for unbounded in (SimpleNamespace(share=share, sandbox=SimpleNamespace(limits=None)), SimpleNamespace(share=None, sandbox=runner.sandbox)):
        assert AttemptRunner._bounds(unbounded, job_spec(), slots=2) == Bounds()
        assert AttemptRunner._bounds(unbounded, asked, slots=2) == Bounds(memory_bytes=2**30)


def test_the_disk_an_attempt_takes_is_its_allocated_blocks_each_file_once_without_the_services_input_copies(tmp_path: Path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "model.bin").write_bytes(os.urandom(2**20))
    os.link(tmp_path / "checkpoints" / "model.bin", tmp_path / "same-file")  # no way to hide a file: counted once
    with open(tmp_path / "sparse", "wb") as sparse:  # 1 GB long, nothing written: takes no disk
        sparse.truncate(2**30)
    (tmp_path / "inputs").mkdir()  # the service's copies of the job's inputs, not the job's writing
    (tmp_path / "inputs" / "dataset").write_bytes(os.urandom(4 * 2**20))
    (tmp_path / "elsewhere").symlink_to(tmp_path / "inputs")
    used = directory_bytes(tmp_path, skip=frozenset({"inputs"}))
    assert 2**20 <= used < 2**20 + 64 * 1024, used

    watch = DiskWatch(tmp_path, limit_bytes=3 * 2**20, every=0.05, skip=frozenset({"inputs"}))
    try:
        assert not watch.over()
        (tmp_path / "more").write_bytes(os.urandom(3 * 2**20))
        deadline = time.monotonic() + 30
        while not watch.over():
            assert time.monotonic() < deadline, watch.used
            time.sleep(0.05)
    finally:
        watch.stop()


@pytest.mark.skipif(available() is None or own_group("cpu") is None, reason="no writable memory, pids and cpu cgroups here")
def test_the_kernel_holds_an_attempts_processes_to_its_cores_and_counts_how_often(tmp_path: Path):
    limits = AttemptLimits.create(f"trainyard-test-{os.getpid()}", Bounds(memory_bytes=2**30, cpu_cores=1), max_processes=64)
    try:
        assert limits.bounds == Bounds(memory_bytes=2**30, cpu_cores=1)
        if (limits.cpu_dir / "cpu.max").exists():
            assert (limits.cpu_dir / "cpu.max").read_text().split() == ["100000", "100000"]
            (limits.cpu_dir / "cpu.max").write_text("5000 100000")  # a twentieth of a core: held back even on a busy machine
        else:
            assert (limits.cpu_dir / "cpu.cfs_quota_us").read_text().strip() == "100000"
            (limits.cpu_dir / "cpu.cfs_quota_us").write_text("5000")
        spin = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass"
        busy = [subprocess.Popen(limited([sys.executable, "-c", spin], 1024, limits, None)) for _ in range(2)]
        assert [process.wait(60) for process in busy] == [0, 0]
        assert limits.throttled() > 0.5, limits.throttled()
    finally:
        limits.remove()
