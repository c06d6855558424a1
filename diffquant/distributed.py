"""torch.distributed glue: the same command scales out under ``torchrun`` (gloo on CPU, nccl on CUDA).

Work is sharded by batch index and results are merged on rank 0, which alone prints and writes.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes (WORLD_SIZE > 1); return (rank, world size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and dist.is_available() and not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    return rank_and_world()


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order), None elsewhere; [obj] without a process group."""
    rank, world = rank_and_world()
    if world == 1:
        return [obj]
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
