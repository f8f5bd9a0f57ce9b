"""A warm interpreter: what a worker starts ahead of time, in an attempt's sandbox, so that an
attempt's processes skip the second or more of importing torch and accelerate.

    python -m workers.warm SLOT_RUN_DIR/

It imports torch, accelerate and the training package (no CUDA initialised, no thread pool started:
nothing that a fork would break), then waits on stdin for one attempt: a JSON line holding the very
`accelerate launch` command line a cold start would run (workers/launch.py) and the processes'
environment. Accelerate's own parser and environment functions read that command, so every rank
gets exactly the environment the launcher would give it; torchrun's per-rank variables are added
as torchrun sets them. One process runs the training here; several are forked from here, one per
rank, each line of their output prefixed `[default<rank>]:` as torchrun's `--tee` prefixes it
(workers/supervisor.split_rank reads it). Used once: the worker starts a fresh one when its
attempt ends (workers/warm_pool.py). The slot's run directory is on the command line so that the processes
of an attempt show their directory, as a cold start's do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading

# The imports a training pays for at start, paid before any attempt is known.
import accelerate.commands.launch as accelerate_launch
import torch
import torch._dynamo  # noqa: F401  (imported by the optimizer's constructor: over a second on a busy CPU)
from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

import workers.training.__main__ as training  # the training package and all it imports

ENTRY = "workers.training"  # the module a cold start runs
TERMINATE_GRACE_SECONDS = 15.0


def main() -> int:
    line = sys.stdin.readline()
    if not line:
        return 0  # the worker let this one go unused
    order = json.loads(line)
    os.environ.update(order["env"])  # what differs from this process's start (WarmInterpreter.hand_over)
    for name in order["unset"]:
        os.environ.pop(name, None)
    args = accelerate_launch.launch_command_parser().parse_args(order["command"])
    args, _, _ = accelerate_launch._validate_launch_command(args)
    if args.num_processes == 1:
        _, env = prepare_simple_launcher_cmd_env(args)
        os.environ.update(env)
        return run_rank(args)
    os.environ.update(prepare_multi_gpu_env(args))
    return run_ranks(args)


def run_rank(args) -> int:
    """The training, in this process, with its command line and thread count as launched."""
    if threads := os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))  # torch read the variable at import, before it was set
    sys.argv = [ENTRY, *args.training_script_args]
    try:
        return training.main()  # what `python -m workers.training` runs
    except SystemExit as end:  # argparse's, on a bad command line
        return end.code if isinstance(end.code, int) else 1


def run_ranks(args) -> int:
    """One forked process per local rank, with torchrun's variables; their output relayed with
    torchrun's prefix. If one fails the others are stopped, as torchrun stops them."""
    size, node, nodes = args.num_processes // args.num_machines, args.machine_rank, args.num_machines
    ranks: dict[int, int] = {}
    readers: list[int] = []
    # All forks before any thread starts: a child gets only the forking thread, and a lock another
    # thread held (the relays' stdout) would stay held in it for ever.
    for local_rank in range(size):
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:
            for fd in [*readers, reader]:
                os.close(fd)
            os.dup2(writer, 1)
            os.dup2(writer, 2)
            rank = node * size + local_rank
            os.environ.update({
                "MASTER_ADDR": args.main_process_ip if nodes > 1 else "127.0.0.1", "MASTER_PORT": str(args.main_process_port),
                "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(size * nodes), "LOCAL_WORLD_SIZE": str(size),
                "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size * nodes),
                "ROLE_NAME": "default", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            })
            code = 1
            try:
                code = run_rank(args)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(writer)
        ranks[pid] = local_rank
        readers.append(reader)
    # The supervisor's SIGTERM (preemption) reaches the ranks themselves: they checkpoint and exit,
    # and this process reports how they ended.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = threading.Lock()
    relays = [threading.Thread(target=_relay, args=(reader, local_rank, lock)) for local_rank, reader in enumerate(readers)]
    for relay in relays:
        relay.start()
    code = _wait(ranks)
    for relay in relays:
        relay.join()
    return code


def _wait(ranks: dict[int, int]) -> int:
    """The first failed rank's exit code (128 + signal for a killed one), 0 if all succeeded."""
    failed = 0
    while ranks:
        pid, status = os.wait()
        if ranks.pop(pid, None) is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
        if code and not failed:
            failed = code
            _signal(list(ranks), signal.SIGTERM)
            killer = threading.Timer(TERMINATE_GRACE_SECONDS, _signal, args=(list(ranks), signal.SIGKILL))
            killer.daemon = True
            killer.start()
    return failed


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited already
            os.kill(pid, sig)


def _relay(reader: int, local_rank: int, lock: threading.Lock) -> None:
    prefix = f"[default{local_rank}]:".encode()
    with open(reader, "rb") as lines:
        for line in lines:
            with lock:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()


if __name__ == "__main__":
    sys.exit(main())
