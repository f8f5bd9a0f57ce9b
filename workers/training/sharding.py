"""The `fsdp` strategy: parameters, gradients and optimizer state sharded across the processes.

Why torch's own FSDP2 (`fully_shard`) and not Accelerate's FSDP plugin: the plugin does not apply
on the CPU (with ACCELERATE_USE_FSDP=true the state stays MULTI_CPU and the model is not sharded),
and the engine is tested on CPU processes over gloo. `fully_shard` shards the same way on gloo and
on NCCL, so one code path runs in the tests and on GPUs. Accelerate still prepares the optimizer,
the dataloaders and the schedule (accumulation, batch dispatch, the schedule's count); only the
model is left out of `accelerator.prepare`, which would wrap it in DDP.

The model is sharded per transformer block (torchtitan's layout): each block's parameters are
all-gathered just before its forward and backward and freed after, so a process holds one block
whole at a time besides its shards. Gradients are reduce-scattered after every micro-batch, also
inside an accumulation window: accumulating them unsharded would hold a full gradient per process,
which is what sharding is for.

Checkpoints hold the sharded state as torch.distributed.checkpoint (DCP) files, each process
writing its own shards in the background (ShardedState); DCP reshards on load, so a checkpoint
resumes on any number of processes. model.safetensors is still the full, unsharded model.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from api_schemas import FSDPConfig, JobSpec
from workers.training.data import SpecError
from workers.training.hf import HFModel
from workers.training.model import GPT, MLPClassifier

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fsdp_options(spec: JobSpec) -> FSDPConfig:
    return spec.training.fsdp or FSDPConfig()


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as one unit each: a GPT's blocks, an `hf` model's transformer layers (the
    classes transformers itself keeps whole, `_no_split_modules`), an MLP's hidden layers. The
    rest (embeddings, final norm, head) is the root's unit."""
    if isinstance(model, GPT):
        return list(model.blocks)
    if isinstance(model, MLPClassifier):
        return [layer for layer in model.mlp if isinstance(layer, nn.Linear)]
    if isinstance(model, HFModel):
        names = set(getattr(model.hf, "_no_split_modules", None) or ())
        units = [module for module in model.modules() if type(module).__name__ in names]
        if not units:
            raise SpecError(f"training.strategy: {type(model.hf).__name__} names no transformer block classes to shard by")
        return units
    raise SpecError(f"training.strategy: `fsdp` cannot shard a {type(model).__name__}")


def shard_model(model: nn.Module, spec: JobSpec, device: torch.device) -> nn.Module:
    """`model` sharded in place across every process (fully_shard per unit, then the root), as the
    spec's fsdp options ask; before the optimizer is built, since sharding replaces the parameters."""
    options = fsdp_options(spec)
    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model.to(device)
    units = shard_units(model)
    if options.activation_checkpointing:
        # The wrapper's state-dict hooks drop its own name, so checkpoints keep the model's names.
        units = [wrap_in_place(model, unit, checkpoint_wrapper(unit)) for unit in units]
    if spec.training.compile:
        # Each unit compiled on its own, before sharding (torchtitan's order): the all-gathers and
        # reduce-scatters stay FSDP's hooks between compiled blocks, and Module.compile() keeps
        # the parameters' names, so checkpoints are the eager model's.
        for unit in units:
            unit.compile()
    settings = {
        "mesh": mesh,
        "reshard_after_forward": options.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[options.param_dtype], reduce_dtype=DTYPES[options.reduce_dtype]),
        "offload_policy": CPUOffloadPolicy(pin_memory=True) if options.cpu_offload else None,
    }
    if settings["offload_policy"] is None:
        del settings["offload_policy"]  # fully_shard's default is its own no-offload policy object
    for unit in units:
        fully_shard(unit, **settings)
    fully_shard(model, **settings)
    return model


def wrap_in_place(root: nn.Module, module: nn.Module, wrapper: nn.Module) -> nn.Module:
    """Put `wrapper` where `module` sits in `root`'s tree."""
    name = next(name for name, each in root.named_modules() if each is module)
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name), child, wrapper)
    return wrapper


def ensure_process_group(device: torch.device) -> None:
    """A single process has no process group (Accelerate makes none); sharding needs one, of one
    rank. accelerator.end_training() destroys it like Accelerate's own."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on the CPU, under the model's own names, on the main process (empty
    elsewhere); every process must call it (it all-gathers)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class ShardedState:
    """The model's and optimizer's sharded state in DCP files: every process writes its shards.

    save() copies the state into CPU buffers kept from one save to the next (pinned on a GPU) and
    returns; a background thread writes the files, and its collectives (process 0 collects the
    write plans and writes the metadata) go over a process group of their own, so they never
    interleave with training's. Once wait() returns on process 0, every process's files are written.
    """

    def __init__(self, device: torch.device):
        self.group = dist.new_group(backend="gloo")
        cuda = device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda))
        self.pending: Future | None = None

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        self.wait()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        self.pending = dcp.async_save(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory, process_group=self.group, async_stager=self.stager,
        )

    def wait(self) -> None:
        """Until the save in flight, if any, is written (by every process, on process 0)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Load into this layout whatever number of processes wrote it: DCP reads each process's part."""
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=directory, process_group=self.group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def close(self) -> None:
        self.wait()
        self.stager.close()
