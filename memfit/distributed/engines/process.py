"""Joining the process group for DeepSpeed and FSDP, on CUDA (NCCL) and on the CPU (gloo).

On CUDA this is what accelerate does itself (NCCL; DeepSpeed's comm for ZeRO). On CPU accelerate would
give gloo and a plain multi-CPU state, where it refuses DeepSpeed and FSDP; the state is then marked
DEEPSPEED (engine set up by accelerate's DeepSpeed plugin) or MULTI_GPU (the only state from which
accelerate enables its FSDP plugin). The device stays the CPU; everything after that is the libraries'
own code.
"""

from __future__ import annotations

import os

from memfit.distributed.engines.base import on_cuda
from memfit.distributed.launch import free_port


def single_process_env() -> None:
    """A one-process group for DeepSpeed / FSDP started without a launcher (python -m memfit.train)."""
    env = os.environ
    if "LOCAL_RANK" in env or "RANK" in env:
        return
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))


def join_process_group(deepspeed: bool, timeout_s: int = 600) -> None:
    """Build accelerate's process state for DeepSpeed (``deepspeed=True``) or FSDP before the Trainer;
    every collective of the group gives up after ``timeout_s`` (``distributed.timeout_s``)."""
    from datetime import timedelta

    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    single_process_env()
    AcceleratorState._reset_state(reset_partial_state=True)
    cuda = on_cuda()
    timeout = timedelta(seconds=timeout_s)
    if deepspeed and cuda:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        try:
            state = PartialState(timeout=timeout)
        finally:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
    else:
        state = PartialState(cpu=not cuda, timeout=timeout)
    if not cuda:
        state.distributed_type = DistributedType.DEEPSPEED if deepspeed else DistributedType.MULTI_GPU
        if deepspeed:  # DeepSpeed's comm layer adopts the gloo group (zero.Init reads its world size)
            from deepspeed import comm

            comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=timeout)
