"""One trainer process, or one per rank under `torchrun` (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from opd_cache.engine import resolve_device


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: object = None
    data_group: object = None
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device_name: str = "auto") -> DistEnv:
    """Single process unless WORLD_SIZE > 1 (torchrun); then one process group per the device type."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_name)
    if world_size == 1:
        return DistEnv(device=device)
    from torch.distributed.device_mesh import init_device_mesh

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (world_size,))
    data_group = dist.new_group(backend="gloo")  # the loader thread's broadcasts, apart from training collectives
    return DistEnv(dist.get_rank(), world_size, device, mesh, data_group, owns)
