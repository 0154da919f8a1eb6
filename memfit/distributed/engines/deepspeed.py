"""DeepSpeed ZeRO stages 1-3 (+ CPU offload of optimizer state, and of parameters at stage 3)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

from memfit.distributed import config as cfgs
from memfit.distributed.engines.base import (_STATE, Engine, _sharded_trainer_kwargs, accelerate_file_text,
                                             device_kind, dump_json, hidden_size_of, write_text_atomic)
from memfit.distributed.ranks import rank_info
from memfit.distributed.engines.process import join_process_group
from memfit.spec.run import RunSpec


class DeepSpeed(Engine):
    sharded = True

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"zero{stage}"
        self.flattens_parameters = stage == 3

    # ---------------------------------------------------------------- files
    def config(self, run: RunSpec, *, device: cfgs.Device = "cuda", hidden_size: Optional[int] = None) -> dict:
        return cfgs.deepspeed_config(run, device=device, hidden_size=hidden_size)

    def emitted_files(self, run: RunSpec, *, device: cfgs.Device, hidden_size: Optional[int]) -> dict[str, str]:
        return {cfgs.DEEPSPEED_FILE: dump_json(self.config(run, device=device, hidden_size=hidden_size))}

    def reasons(self, run: RunSpec, *, cpu: bool) -> list[str]:
        s = run.strategy
        out = []
        if importlib.util.find_spec("deepspeed") is None:
            out.append(f"zero_stage={s.zero_stage} needs DeepSpeed: pip install deepspeed==0.19.8 "
                       "(DS_BUILD_OPS=0), or use fsdp=full_shard / zero_stage=0")
        if s.offload != "none" and s.optimizer == "sgd":
            out.append("optimizer=sgd with DeepSpeed offload: ZeRO-Offload steps with its CPU AdamW; use "
                       "optimizer=adamw, or offload=none")
        return out

    # ---------------------------------------------------------------- one process
    def process_config(self, run: RunSpec) -> dict:
        """The DeepSpeed config for this process: this device, the model's hidden size, the launched world."""
        ds = self.config(run, device=device_kind(), hidden_size=hidden_size_of(run))
        s = run.strategy
        # (under Ulysses the data parallelism is world / N: accelerate sets train_batch_size to that last,
        # accelerate/accelerator.py:2359-2365, after transformers checked this one against its own, world-wide)
        ds["train_batch_size"] = s.micro_batch_size * s.grad_accum * rank_info()[2]
        return ds

    def _join(self, run: RunSpec) -> None:
        join_process_group(deepspeed=True, timeout_s=run.distributed.timeout_s)
        if self.stage == 3:  # from_pretrained partitions the weights as it loads them (zero.Init)
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            # transformers holds a weak reference: keep it alive for the whole run.
            _STATE["hf_ds_config"] = HfDeepSpeedConfig(self.process_config(run))

    def write_configs(self, run: RunSpec, output_dir: Path) -> list[Path]:
        ds_file = write_text_atomic(dump_json(self.process_config(run)), Path(output_dir) / cfgs.DEEPSPEED_FILE)
        acc = accelerate_file_text(run, device_kind(), deepspeed_config_file=str(ds_file.resolve()), header=True)
        return [ds_file, write_text_atomic(acc, Path(output_dir) / cfgs.ACCELERATE_FILE)]

    def trainer_kwargs(self, run: RunSpec, output_dir: Path) -> dict[str, Any]:
        kwargs = _sharded_trainer_kwargs(self, run, output_dir)
        ds = self.process_config(run)
        kwargs.update(deepspeed=ds, bf16=ds["bf16"]["enabled"], fp16=ds["fp16"]["enabled"])
        if run.strategy.sequence_parallel > 1:  # Ulysses, run by accelerate's DeepSpeed prepare
            from memfit.distributed.parallelism import ulysses_config

            kwargs["parallelism_config"] = ulysses_config(run)
        return kwargs

    # ---------------------------------------------------------------- saving
    def gathered_state_dict(self, trainer: Any, run: RunSpec) -> Optional[dict]:
        engine = trainer.model_wrapped
        if self.stage == 3 and run.strategy.trains_adapter:
            # PEFT under ZeRO-3: gather only the trained (adapter) parameters, not the frozen base.
            return engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
        return trainer.accelerator.get_state_dict(engine)

