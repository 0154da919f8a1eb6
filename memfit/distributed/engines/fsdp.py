"""FSDP2 (``fully_shard``) through accelerate: full_shard or shard_grad_op, optional CPU offload."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from memfit.distributed import config as cfgs
from memfit.distributed.engines.base import (Engine, _sharded_trainer_kwargs, accelerate_file_text,
                                             device_kind, write_text_atomic)
from memfit.distributed.engines.process import join_process_group
from memfit.spec.run import RunSpec


class Fsdp(Engine):
    sharded = True
    flattens_parameters = True

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.name = f"fsdp-{mode}"

    def config(self, run: RunSpec, *, device: cfgs.Device = "cuda", hidden_size: Optional[int] = None) -> dict:
        return cfgs.fsdp_trainer_config(run)

    def emitted_files(self, run: RunSpec, *, device: cfgs.Device, hidden_size: Optional[int]) -> dict[str, str]:
        return {cfgs.ACCELERATE_FILE: accelerate_file_text(run, device)}

    def reasons(self, run: RunSpec, *, cpu: bool) -> list[str]:
        s = run.strategy
        out = []
        if s.offload == "optimizer":
            out.append("offload=optimizer with FSDP: FSDP's CPU offload moves parameters, gradients and "
                       "optimizer state together; use offload=optimizer+params, or zero_stage>=1 for "
                       "optimizer-only offload")
        if cpu and s.offload != "none":
            out.append("FSDP offload on the CPU device: FSDP2's CPU offload pins host memory, which needs a "
                       "CUDA GPU (and there is nothing to offload from); use offload=none, or zero_stage=3 "
                       "with offload to exercise offloading on the CPU")
        return out

    def _join(self, run: RunSpec) -> None:
        # What ``accelerate launch`` exports for FSDP (transformers reads it while loading weights: rank 0
        # reads them, the others start on the meta device); before the process group, since accelerate
        # picks "cuda:nccl,cpu:gloo" from it.
        f = cfgs.fsdp_trainer_config(run)
        os.environ["ACCELERATE_USE_FSDP"] = "true"
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = str(f["cpu_ram_efficient_loading"]).lower()
        os.environ["FSDP_OFFLOAD_PARAMS"] = str(f["cpu_offload"]).lower()
        os.environ["FSDP_STATE_DICT_TYPE"] = f["state_dict_type"]
        join_process_group(deepspeed=False)

    def write_configs(self, run: RunSpec, output_dir: Path) -> list[Path]:
        return [write_text_atomic(accelerate_file_text(run, device_kind(), header=True),
                                  Path(output_dir) / cfgs.ACCELERATE_FILE)]

    def trainer_kwargs(self, run: RunSpec, output_dir: Path) -> dict[str, Any]:
        kwargs = _sharded_trainer_kwargs(self, run, output_dir)
        kwargs.update(fsdp=True, fsdp_config=cfgs.fsdp_trainer_config(run))
        return kwargs

    def gathered_state_dict(self, trainer: Any, run: RunSpec) -> Optional[dict]:
        return trainer.accelerator.get_state_dict(trainer.model)
