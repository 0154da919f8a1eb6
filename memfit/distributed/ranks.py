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


def this_process() -> dict:
    """Where this process sits: global rank, node rank (torchrun's GROUP_RANK), local rank, host name."""
    import socket

    rank, local_rank, world = rank_info()
    return {"rank": rank, "node_rank": int(os.environ.get("GROUP_RANK", 0)), "local_rank": local_rank,
            "world_size": world, "host": socket.gethostname()}


def gather_layout() -> list[dict]:
    """:func:`this_process` of every rank, rank 0 first (one object gather; collective)."""
    dist = _group()
    if dist is None or dist.get_world_size() == 1:
        return [this_process()]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, this_process())
    return out


def layout_line(ranks: list[dict]) -> str:
    """``world size 2 on 2 node(s): rank 0 = node 0 local 0, rank 1 = node 1 local 0``."""
    nodes = len({r["node_rank"] for r in ranks})
    each = ", ".join(f"rank {r['rank']} = node {r['node_rank']} local {r['local_rank']}" for r in ranks)
    return f"world size {len(ranks)} on {nodes} node(s): {each}"


def set_collective_timeout(seconds: int) -> None:
    """Every later collective gives up after ``seconds`` (``distributed.timeout_s``), in every process group:
    the ones up now (on the CPU the Trainer builds DDP's group without its ddp_timeout) and the ones an engine
    makes later (DeepSpeed's, built inside ``trainer.train``): ``new_group`` without a timeout takes
    ``_get_default_timeout(backend)``, which reads the module's ``default_pg_timeout`` /
    ``default_pg_nccl_timeout`` when it is called (torch/distributed/distributed_c10d.py,
    ``_new_group_with_tag``), 30 / 10 minutes unless set here. Without it a ZeRO-2 rank waited on a hung peer
    past 180 s (the whole fault matrix)."""
    dist = _group()
    c10d = getattr(dist, "distributed_c10d", None)
    if c10d is None or not hasattr(c10d, "_set_pg_timeout"):
        return
    from datetime import timedelta

    timeout = timedelta(seconds=seconds)
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if isinstance(getattr(c10d, name, None), timedelta):
            setattr(c10d, name, timeout)
    for group in list(getattr(c10d._world, "pg_map", {})) or [None]:
        try:
            c10d._set_pg_timeout(timeout, group)
        except (ValueError, AssertionError, RuntimeError):  # a group this rank is not in, or not a real one
            pass


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    dist = _group()
    if dist is not None:
        dist.barrier()


def finish() -> None:
    """The end of a launched process's work: every rank arrives, then the process group is left here,
    while the interpreter and every peer are alive (not from an atexit handler racing the other ranks'
    exits), and really freed: see :func:`release_world_refs`. Nothing without a process group."""
    dist = _group()
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()
        release_world_refs()


def release_world_refs() -> None:
    """Drop the references to a destroyed group that torch.distributed modules keep in default arguments.

    ``torch.distributed.nn.functional``'s collectives (and a few classes: ZeroRedundancyOptimizer,
    ShardedGradScaler) take ``group=group.WORLD`` as a default argument, evaluated when the module is
    imported. Imported after ``init_process_group`` (torch.optim imports torch.distributed.nn lazily,
    through torch._dynamo, when the first optimizer is built), each such default keeps the world group
    alive after ``destroy_process_group``: gloo's worker and transport threads and rank 0's TCPStore
    server live on into interpreter shutdown, where the process now and then aborts with ``terminate
    called without an active exception`` (SIGABRT). Imported before the group, those defaults are None
    (the default group at call time); they are set back to None here.
    """
    import sys
    import types

    try:
        from torch.distributed import ProcessGroup
    except ImportError:  # pragma: no cover - torch without distributed
        return

    def is_group(value) -> bool:  # by the type's MRO: no isinstance hooks (deprecated torch objects warn)
        return ProcessGroup in type(value).__mro__

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for obj in list(vars(module).values()):
            for fn in [obj, *(vars(obj).values() if type(obj) is type else ())]:
                if type(fn) is types.FunctionType and fn.__defaults__ and any(map(is_group, fn.__defaults__)):
                    fn.__defaults__ = tuple(None if is_group(d) else d for d in fn.__defaults__)
