"""A guard against PyTorch's deadlock at the end of a gloo job (seen here twice: a rank hung for
ever after its last step, and accelerate's own `test_sync.py` aborting at exit).

A gloo process group's worker thread drops each finished collective's work, and with it tensors
that Python still knows of, so it takes the GIL to do it. When the process group is then destroyed
by a thread holding the GIL (DDP's reducer freed as `main()` returns, or the interpreter
finalising), that thread waits for the worker thread, which waits for the GIL: a deadlock, or an
abort once the interpreter is gone (pytorch/pytorch#179291 describes it; its fix was abandoned).

The guard: before the process group is destroyed, and at exit, wait a moment with the GIL released,
so the worker threads finish dropping what the last collectives left. Installed in every process
of a built-in job (workers/training/__main__.py) and of a script job (workers/script_hooks.py).
"""

from __future__ import annotations

import atexit
import time

SETTLE_SECONDS = 0.05  # far more than a worker thread needs for the GIL once it is free


def guard_process_group_exit() -> None:
    import torch.distributed as dist

    if getattr(dist.destroy_process_group, "_trainyard_guarded", False) or not dist.is_available():
        return
    destroy = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        if dist.is_initialized():
            time.sleep(SETTLE_SECONDS)
        return destroy(*args, **kwargs)

    destroy_process_group._trainyard_guarded = True
    dist.destroy_process_group = destroy_process_group
    atexit.register(lambda: dist.is_initialized() and time.sleep(SETTLE_SECONDS))
