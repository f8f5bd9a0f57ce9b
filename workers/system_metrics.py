"""An attempt's vital signs, sampled by its supervisor every few seconds and recorded as `sys/…`
series through the normal metrics path, at the step the training has reached.

- `sys/cpu_percent`, `sys/memory_mb`: the attempt's whole process tree (launcher and ranks); 100 %
  is one core busy.
- `sys/gpu_utilization_percent`, `sys/gpu_memory_mb`, `sys/gpu_power_w`: through NVML, summed (the
  utilisation averaged) over the GPUs the attempt was given; absent without GPUs or without NVML.
- `sys/wall_time`: Unix time of the sample, which lets a chart put the steps on a time axis.
"""

from __future__ import annotations

import logging
import time

import psutil

log = logging.getLogger("trainyard.worker")


class SystemSampler:
    def __init__(self, pid: int, gpu_indices: list[int] | None):
        self.root = psutil.Process(pid)
        self.processes: dict[int, psutil.Process] = {}  # kept between samples: cpu_percent measures since the last call
        self.gpus = _nvml_handles(gpu_indices or [])

    def sample(self, step: int) -> list[tuple[int, str, float]]:
        values = {"sys/wall_time": time.time(), **self._processes(), **self._gpus()}
        return [(step, name, value) for name, value in values.items()]

    def _processes(self) -> dict[str, float]:
        try:
            tree = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:  # the launcher is gone: nothing left to measure
            return {}
        cpu = memory = 0.0
        for process in tree:
            process = self.processes.setdefault(process.pid, process)
            try:
                cpu += process.cpu_percent()  # 0.0 on a process's first sample
                memory += process.memory_info().rss
            except psutil.Error:  # it exited between the listing and the reading
                continue
        return {"sys/cpu_percent": cpu, "sys/memory_mb": memory / 2**20}

    def _gpus(self) -> dict[str, float]:
        if not self.gpus:
            return {}
        import pynvml

        try:
            utilization = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.gpus]
            memory = sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in self.gpus)
            power = sum(pynvml.nvmlDeviceGetPowerUsage(h) for h in self.gpus)  # milliwatts
        except pynvml.NVMLError:
            log.warning("NVML stopped answering; no more GPU samples for this attempt", exc_info=True)
            self.gpus = []
            return {}
        return {
            "sys/gpu_utilization_percent": sum(utilization) / len(utilization),
            "sys/gpu_memory_mb": memory / 2**20,
            "sys/gpu_power_w": power / 1000,
        }


def _nvml_handles(indices: list[int]) -> list:
    """NVML handles of the GPUs at these indices, or none where NVML is missing (no driver, no package)."""
    if not indices:
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
    except Exception:  # ImportError, or any NVMLError: a host without a usable driver samples no GPUs
        log.info("no NVML here: the attempt's GPUs are not sampled", exc_info=True)
        return []
