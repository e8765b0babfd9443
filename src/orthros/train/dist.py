"""Processes: single, or `torchrun` data parallel with FSDP2 (`fully_shard`).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; we join the group (NCCL on
GPUs, gloo on CPU), shard every block and then the root, and keep
parameters in fp32 (bf16 comes from autocast, as in the single process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def on(self) -> bool:
        return self.world > 1


def setup(device: str = "auto") -> Dist:
    """Join the torchrun process group if there is one; pick this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("train.device is cuda but no CUDA device is available")
    if use_cuda:
        dev = torch.device(device if ":" in device else f"cuda:{local}")
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank=rank, world=world, local_rank=local, device=dev)


def teardown(d: Dist) -> None:
    if d.on and dist.is_initialized():
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.on:
        dist.barrier()


def all_sum(d: Dist, x: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over processes (a no-op for one process)."""
    if d.on:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def gather_objects(d: Dist, obj) -> list:
    if not d.on:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def shard(model: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """FSDP2: shard each block, then the root (embeddings, final norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(d.device.type, (d.world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def set_grad_sync(model: torch.nn.Module, d: Dist, sync: bool) -> None:
    """Skip the gradient reduce-scatter on all but the last micro-batch of a step."""
    if d.on and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
