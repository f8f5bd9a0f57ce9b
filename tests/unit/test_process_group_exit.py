"""The guard against gloo's deadlock at exit (workers/process_group_exit.py) waits, then destroys."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_guarded_destroy_settles_then_destroys_a_gloo_group_and_the_process_exits_cleanly():
    # In a process of its own: a process group is process-wide state.
    program = textwrap.dedent("""
        import time
        import torch, torch.distributed as dist
        from workers.process_group_exit import SETTLE_SECONDS, guard_process_group_exit
        guard_process_group_exit()
        guard_process_group_exit()  # twice: still one wrapper
        assert dist.destroy_process_group._trainyard_guarded
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        tensors = [torch.zeros(4)]
        dist.all_gather(tensors, torch.ones(4))  # a collective that leaves its work to the gloo thread
        started = time.perf_counter()
        dist.destroy_process_group()
        assert time.perf_counter() - started >= SETTLE_SECONDS
        assert not dist.is_initialized()
        print("done")
    """)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
