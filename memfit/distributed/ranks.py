"""Who this process is in its launch: rank, local rank, world size, rank 0. The one place memfit asks.

torch.distributed when the process group is up, else the launcher's environment (torchrun's RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE), else a single process. torch is imported inside the functions.
"""

from __future__ import annotations

import os


def _group():
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - planning-only install
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def rank_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size)."""
    env = os.environ
    dist = _group()
    if dist is not None:
        return dist.get_rank(), int(env.get("LOCAL_RANK", 0)), dist.get_world_size()
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    """Rank 0 of the launch, or the only process."""
    return rank_info()[0] == 0


def launched_world() -> tuple[int, int]:
    """(world size, processes on this node) of the current launch; (1, 1) without a launcher."""
    world = rank_info()[2]
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    dist = _group()
    if dist is not None:
        dist.barrier()


def finish() -> None:
    """The end of a launched process's work: every rank arrives, then the process group is left here,
    while the interpreter and every peer are alive (not from an atexit handler racing the other ranks'
    exits). Nothing without a process group."""
    dist = _group()
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()
