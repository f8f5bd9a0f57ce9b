"""The worker's samples of an attempt's processes: the whole tree's CPU and memory, at the given step."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from workers.system_metrics import SystemSampler

# A launcher whose child does the work, as `accelerate launch` and its ranks do.
BUSY_CHILD = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'x = bytearray(64 << 20)\\nwhile True: pass'])"


def test_an_attempt_is_sampled_whole_tree_cpu_and_memory_at_its_step():
    process = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    try:
        sampler = SystemSampler(process.pid, gpu_indices=None)
        time.sleep(1.0)  # the child starts; cpu_percent measures from the first sample to the next
        sampler.sample(7)
        time.sleep(1.0)
        samples = {name: (step, value) for step, name, value in sampler.sample(7)}
    finally:
        for child in psutil.Process(process.pid).children():
            child.kill()
        process.kill()
        process.wait()
    assert set(samples) == {"sys/wall_time", "sys/cpu_percent", "sys/memory_mb"}  # no GPUs asked for: no NVML series
    assert {step for step, _ in samples.values()} == {7}
    assert samples["sys/cpu_percent"][1] > 1  # the idle parent's busy child (a low bar: the cores are shared)
    assert samples["sys/memory_mb"][1] > 64  # the child's 64 MiB buffer
    assert abs(samples["sys/wall_time"][1] - time.time()) < 5


def test_a_finished_attempt_samples_nothing_but_the_time():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    sampler = SystemSampler(process.pid, gpu_indices=None)
    process.wait()
    assert [name for _, name, _ in sampler.sample(1)] == ["sys/wall_time"]
