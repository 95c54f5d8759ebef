"""torch.distributed helpers of the training loop: rank and world size, torchrun initialisation,
a summing all-reduce that is the identity in a single process."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def maybe_init_distributed() -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (gloo on CPU, nccl on CUDA)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return world()


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` over the processes in place (no-op in a single process); returns ``t``."""
    if world()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
