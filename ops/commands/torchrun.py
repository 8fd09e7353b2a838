"""The process group of a command run under ``torchrun`` (``WORLD_SIZE`` processes, each
with its ``RANK`` and ``LOCAL_RANK``): which process this is, the group joined on first
need, and left when the command ends. A plain run is rank 0 of 1."""
from __future__ import annotations

import os

import torch


def rank() -> int:
    """This process's rank (0 outside torchrun): rank 0 prints and reports."""
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its machine (0 outside torchrun): the GPU it takes."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def world() -> tuple:
    """(rank, world size, distributed module or None) under torchrun, else (0, 1, None)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return 0, 1, None
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), size, dist


def leave_process_group() -> None:
    """Leaves the process group, if this run joined one."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
