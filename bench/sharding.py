"""Memory and speed of strategy `fsdp` against `ddp`: the same model on 2 processes, in one run.

    PYTHONPATH=$PWD .venv/bin/python bench/sharding.py [--steps 12] [--device cpu|cuda] [--layers 6 --width 384]

Each strategy runs as 2 processes (torch.distributed.run; gloo on CPU, NCCL on GPUs) that build
the engine's GPT and AdamW (workers.training: build_model, shard_model, make_optimizer; DDP as
Accelerate wraps it) and train `--steps` steps on random tokens. Each process measures, after its
last backward: the bytes of parameters + gradients + optimizer state it holds (a DTensor counts its
local shard), its peak memory (allocated on a GPU, resident set on the CPU) and tokens/s from step
`--skip` on. Prints one JSON line: per strategy the largest value over the processes, and fsdp's
fractions of ddp's. Target: state about half of ddp's on 2 processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def process_main(args: argparse.Namespace) -> None:
    """One of the two processes of one strategy."""
    import resource

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from api_schemas import JobSpec
    from tests.helpers import tiny_spec
    from workers.training.loop import make_optimizer
    from workers.training.model import build_model
    from workers.training.sharding import shard_model

    cuda = args.device == "cuda"
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    spec = JobSpec.model_validate(tiny_spec(**{
        "model.n_layer": args.layers, "model.n_embd": args.width, "model.n_head": 8, "model.block_size": args.block,
        "training.micro_batch_size": args.batch, "training.strategy": args.strategy, "resources.processes_per_node": 2,
        "resources.device": args.device,
    }))
    torch.manual_seed(0)
    model = build_model(spec.model, args.vocab)
    if args.strategy == "fsdp":
        model = shard_model(model, spec, device)
    else:
        model = DistributedDataParallel(model.to(device), device_ids=[device.index] if cuda else None)
    optimizer = make_optimizer(model, spec)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(args.vocab, (args.batch, args.block + 1), generator=generator)
    inputs, targets = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

    start = None
    for step in range(args.steps):
        if step == args.skip:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        if step < args.steps - 1:
            optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    state = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
    state += sum(local_bytes(t) for per_param in optimizer.state.values() for t in per_param.values() if torch.is_tensor(t))
    peak = torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    measured = torch.tensor([state, peak, -(args.steps - args.skip) * args.batch * args.block / seconds], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)  # the largest per process; tokens/s of the slowest
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "state_mb": measured[0].item() / 2**20, "peak_memory_mb": measured[1].item() / 2**20,
            "tokens_per_s": -measured[2].item() * 2,  # both processes' tokens
            "parameters": sum(p.numel() for p in build_model(spec.model, args.vocab).parameters()),
        }))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of tokens/s")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per process")
    parser.add_argument("--vocab", type=int, default=65)
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)  # set for the processes
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.strategy is not None:
        return process_main(args)

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for strategy in ("ddp", "fsdp"):
            out = Path(scratch) / f"{strategy}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
                       *sys.argv[1:], "--strategy", strategy, "--out", str(out)]
            threads = "1" if args.device == "cpu" else os.environ.get("OMP_NUM_THREADS", "1")
            subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads})
            results[strategy] = json.loads(out.read_text())
    ddp, fsdp = results["ddp"], results["fsdp"]
    print(json.dumps({
        "device": args.device, "processes": 2, "model": f"GPT {args.layers}x{args.width}, block {args.block}, batch {args.batch}/process",
        "parameters": ddp["parameters"], "ddp": ddp, "fsdp": fsdp,
        "state_fraction": round(fsdp["state_mb"] / ddp["state_mb"], 3),
        "peak_memory_fraction": round(fsdp["peak_memory_mb"] / ddp["peak_memory_mb"], 3),
        "tokens_per_s_ratio": round(fsdp["tokens_per_s"] / ddp["tokens_per_s"], 3),
    }))


if __name__ == "__main__":
    main()
