"""FSDP through accelerate: FSDP2 (``fully_shard``) or FSDP1 (``FullyShardedDataParallel``), full_shard or
shard_grad_op, optional CPU offload. ``Fsdp(mode, version)``; the registry holds both versions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from memfit.distributed import config as cfgs
from memfit.distributed.engines.base import (Engine, _sharded_trainer_kwargs, accelerate_file_text,
                                             device_kind, on_cuda, write_text_atomic)
from memfit.distributed.engines.process import join_process_group
from memfit.methods import METHODS
from memfit.spec.run import RunSpec


# FSDP1's transformer_layer_cls_to_wrap: the decoder layer class transformers defines per model_type
DECODER_LAYER_CLASS = {
    "llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer", "gemma": "GemmaDecoderLayer", "gemma2": "Gemma2DecoderLayer",
    "granite": "GraniteDecoderLayer", "mixtral": "MixtralDecoderLayer", "qwen2_moe": "Qwen2MoeDecoderLayer",
    "falcon": "FalconDecoderLayer", "gpt_neox": "GPTNeoXLayer", "gpt_bigcode": "GPTBigCodeBlock",
}


def decoder_layer_class(run: RunSpec) -> Optional[str]:
    """The run's model's decoder layer class name; None where the model cannot be read."""
    from memfit.errors import MemfitError
    from memfit.spec.model import resolve_model

    try:
        return DECODER_LAYER_CLASS.get(resolve_model(run.model).family)
    except MemfitError:
        return None


def launcher_fsdp_version() -> Optional[int]:
    """The FSDP version an ``accelerate launch --config_file`` names (accelerate/utils/launch.py exports
    ``FSDP_VERSION``, "1" when the file has no ``fsdp_version``: accelerate's own default); None when this
    process was not started by accelerate with FSDP."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true" or "FSDP_VERSION" not in os.environ:
        return None
    try:
        version = int(os.environ["FSDP_VERSION"])
    except ValueError:
        return None
    return version if version in (1, 2) else None


def with_launcher_version(run: RunSpec) -> RunSpec:
    """A user's accelerate FSDP config gets the version it names: an FSDP run started by ``accelerate
    launch`` trains (and saves in its run.yaml) the launcher's ``fsdp_version``."""
    version = launcher_fsdp_version()
    if version is None or not run.strategy.fsdp or version == run.strategy.fsdp_version:
        return run
    return run.model_copy(update={"strategy": run.strategy.model_copy(update={"fsdp_version": version})})


class Fsdp(Engine):
    sharded = True
    flattens_parameters = True

    def __init__(self, mode: str, version: int = 2) -> None:
        self.mode, self.version = mode, version
        self.name = f"fsdp{'1' if version == 1 else ''}-{mode}"

    def config(self, run: RunSpec, *, device: cfgs.Device = "cuda", hidden_size: Optional[int] = None) -> dict:
        return cfgs.fsdp_trainer_config(run, device)

    def emitted_files(self, run: RunSpec, *, device: cfgs.Device, hidden_size: Optional[int]) -> dict[str, str]:
        return {cfgs.ACCELERATE_FILE: accelerate_file_text(run, device, layer_cls=self._layer_cls(run))}

    def _layer_cls(self, run: RunSpec) -> Optional[str]:
        return decoder_layer_class(run) if self.version == 1 else None

    def reasons(self, run: RunSpec, *, cpu: bool) -> list[str]:
        s = run.strategy
        out = []
        if s.offload == "optimizer":
            out.append("offload=optimizer with FSDP: FSDP's CPU offload moves parameters, gradients and "
                       "optimizer state together; use offload=optimizer+params, or zero_stage>=1 for "
                       "optimizer-only offload")
        if cpu and s.offload != "none":
            out.append(f"FSDP offload on the CPU device: FSDP{self.version}'s CPU offload pins host memory, "
                       "which needs a CUDA GPU (and there is nothing to offload from); use offload=none, or "
                       "zero_stage=3 with offload to exercise offloading on the CPU")
        return out

    def _join(self, run: RunSpec) -> None:
        # What ``accelerate launch`` exports for FSDP (transformers reads it while loading weights: rank 0
        # reads them, the others start on the meta device); before the process group, since accelerate
        # picks "cuda:nccl,cpu:gloo" from it.
        f = cfgs.fsdp_trainer_config(run, device_kind())
        os.environ["ACCELERATE_USE_FSDP"] = "true"  # (the version reaches accelerate in fsdp_config, not FSDP_VERSION)
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = str(f["cpu_ram_efficient_loading"]).lower()
        os.environ["FSDP_OFFLOAD_PARAMS"] = str(f["cpu_offload"]).lower()
        os.environ["FSDP_STATE_DICT_TYPE"] = f["state_dict_type"]
        join_process_group(deepspeed=False, timeout_s=run.distributed.timeout_s)

    def write_configs(self, run: RunSpec, output_dir: Path) -> list[Path]:
        return [write_text_atomic(accelerate_file_text(run, device_kind(), header=True, layer_cls=self._layer_cls(run)),
                                  Path(output_dir) / cfgs.ACCELERATE_FILE)]

    def trainer_kwargs(self, run: RunSpec, output_dir: Path) -> dict[str, Any]:
        kwargs = _sharded_trainer_kwargs(self, run, output_dir)
        kwargs.update(fsdp=True, fsdp_config=cfgs.fsdp_trainer_config(run, device_kind()))
        # accumulation: reduce-scatter every micro-batch (gradients stay sharded) unless the run asks for the HF
        # Trainer's no_sync (transformers trainer.py reads GradientAccumulationPlugin's sync_each_batch)
        kwargs["accelerator_config"] = {**kwargs["accelerator_config"], "gradient_accumulation_kwargs": {
            "sync_each_batch": bool(run.strategy.fsdp_sync_each_batch)}}
        if run.strategy.context_parallel > 1:  # torch context parallelism over the FSDP2 mesh (CUDA only: the
            from memfit.distributed.parallelism import context_config  # pre-flight refuses it elsewhere)
            from memfit.distributed.ranks import rank_info

            kwargs["parallelism_config"] = context_config(run, rank_info()[2])
        return kwargs

    def prepare_trainer(self, trainer: Any, run: RunSpec) -> None:
        """FSDP1 with an adapter method: PEFT's ``fsdp_auto_wrap_policy`` (peft/utils/other.py), as
        transformers' Trainer applied it before 5.x (``_fsdp_qlora_plugin_updates``) and the PEFT FSDP guide
        does — every trainable leaf (lora_A, lora_B) its own unit, the decoder layers units of frozen
        parameters. Without it a decoder layer's FlatParameter mixes frozen and trainable parameters: with
        ``use_orig_params`` it then requires grad as a whole, gets a gradient for the whole layer, and
        accelerate upcasts the whole layer to fp32 under mixed precision (accelerate/accelerator.py, "Upcasted
        low precision parameters"). QLoRA: FSDP1's param dtype is the 4-bit storage dtype (as the Trainer's
        ``_fsdp_qlora_plugin_updates`` set it), which memfit's quant_storage already equals."""
        if self.version != 1:
            return
        if not on_cuda():  # accelerate passes device_id=state.device, "cpu:0" on gloo, which FSDP1 refuses
            import torch  # against the parameters' "cpu" (_init_utils.py _get_compute_device)
            from accelerate.state import PartialState

            PartialState().device = torch.device("cpu")
            trainer.accelerator.state.device = torch.device("cpu")
        if not METHODS[run.strategy.method].fsdp_adapter_units:
            return
        from peft.utils.other import fsdp_auto_wrap_policy

        trainer.accelerator.state.fsdp_plugin.auto_wrap_policy = fsdp_auto_wrap_policy(trainer.model)

    def gathered_state_dict(self, trainer: Any, run: RunSpec) -> Optional[dict]:
        return trainer.accelerator.get_state_dict(trainer.model)

    def adapter_state_dict(self, trainer: Any, run: RunSpec) -> dict:
        """save.mode=adapter: the trained parameters alone, gathered on every rank (collective; #39), never the
        frozen base. FSDP1: each unit that owns a trained parameter (PEFT's wrap policy: lora_A, lora_B) is
        unsharded alone (``FSDP.summon_full_params(unit, recurse=False, writeback=False)``); FSDP2: each trained
        DTensor's ``full_tensor()``. Names as the unwrapped model's state dict spells them."""
        import torch

        model, out = trainer.model, {}
        if self.version == 2:
            for name, p in model.named_parameters():
                if p.requires_grad:
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p
                    out[_plain(name)] = full.detach().to("cpu", copy=True)
            return out
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for prefix, unit in model.named_modules():
            if not isinstance(unit, FSDP):
                continue
            # the unit's own parameters: one wrapper level in their names (deeper ones are nested units')
            names = {_plain(n) for n, p in unit.named_parameters()
                     if p.requires_grad and n.count("_fsdp_wrapped_module") == 1}
            if not names:
                continue
            # inside the context FSDP names parameters without its wrapper prefix (FSDP.named_parameters)
            with FSDP.summon_full_params(unit, recurse=False, writeback=False), torch.no_grad():
                for n, p in unit.named_parameters():
                    if _plain(n) in names:
                        out[_plain(f"{prefix}.{n}" if prefix else n)] = p.detach().to("cpu", copy=True)
        return out

    def save_sharded(self, trainer: Any, out: Path) -> Path:
        """save.mode=sharded: every rank writes its own shards of the model (accelerate's ``save_fsdp_model``
        with the SHARDED_STATE_DICT memfit configures: torch.distributed.checkpoint), no gather (#39)."""
        from accelerate.utils import save_fsdp_model

        dst = Path(out) / "model_sharded"
        save_fsdp_model(trainer.accelerator.state.fsdp_plugin, trainer.accelerator, trainer.model, str(dst))
        return dst


def _plain(name: str) -> str:
    """A parameter's name without FSDP1's wrapper parts, as the unwrapped model names it."""
    return name.replace("_fsdp_wrapped_module.", "").replace("._checkpoint_wrapped_module", "")
