"""QLoRA: LoRA over a base quantized to 4-bit NF4 by bitsandbytes (double quantization optional)."""

from __future__ import annotations

import importlib.util
from typing import Any

from memfit.errors import IncompatibleError
from memfit.methods.base import GC_KWARGS, Parameters, enable_checkpointing
from memfit.methods.lora import Lora
from memfit.methods.qlora.config import QLoraSettings
from memfit.methods.types import ModelLike, NumbersLike, ProfileLike, StrategyLike

# The dtype FSDP / ZeRO-3 flatten parameters to, per precision: QLoRA's quant storage must equal it.
PARAM_DTYPE = {"bf16-mixed": "bf16", "bf16": "bf16", "fp16-mixed": "fp16", "fp32": "fp32"}
STORAGE_BYTES = {"uint8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}  # bnb_4bit_quant_storage element


class QLora(Lora):
    name = family = "qlora"
    fields = (*Lora.fields, *QLoraSettings.model_fields)  # memfit/methods/qlora/config.py
    traced = False  # bitsandbytes kernels have no FakeTensor support
    quantized = True

    # ---------------------------------------------------------------- the estimator's terms
    def frozen(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
               half: float) -> tuple[float, float, bool]:
        """NF4 linears (+ absmax), the rest in fp32 after k-bit preparation (16-bit under ZeRO-3/FSDP)."""
        st, p = strategy, profile
        absmax = p.nf4_absmax_bytes_double_quant if st.double_quant else p.nf4_absmax_bytes
        # prepare_model_for_kbit_training upcasts the rest to fp32, but not under ZeRO-3/FSDP (it breaks
        # their uniform-dtype flattening: fsdp-qlora.md), where it stays in the 16-bit storage dtype
        upcast = p.qlora_fp32_upcast and not (st.fsdp or st.zero_stage == 3)
        other_b = 4.0 if (upcast or st.precision == "fp32") else 2.0
        frozen_bytes = numbers.linear_params * (p.nf4_bytes_per_param + absmax) + numbers.other_params * other_b
        quant_state = numbers.linear_params * absmax
        if st.fsdp and st.quant_storage == "uint8":  # accelerate leaves non-float Params4bit out of FSDP2
            quant_state += numbers.linear_params * p.nf4_bytes_per_param  # (fsdp_utils.py:800-811): replicated
        return frozen_bytes, quant_state, bool(upcast) and st.precision != "fp32"

    def parameters(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                   half: float) -> Parameters:
        # one Linear4bit dequantised to 16-bit at a time, beside the stored weights
        return super().parameters(model, strategy, profile, numbers, half)._replace(
            working_weight=numbers.largest_linear * 2.0)

    def gathered_per_element(self, strategy: StrategyLike, profile: ProfileLike) -> float:
        return STORAGE_BYTES[strategy.quant_storage] / profile.nf4_bytes_per_param  # NF4: 2 values per uint8

    def rules(self, model: Any, hardware: Any, strategy: Any) -> list[str]:
        s = strategy
        out = super().rules(model, hardware, s)
        sharded = s.zero_stage == 3 or s.fsdp in ("full_shard", "shard_grad_op")
        want = PARAM_DTYPE[s.precision]
        if sharded and s.quant_storage != want:
            engine = "ZeRO-3" if s.zero_stage == 3 else f"FSDP {s.fsdp}"
            out.append(f"method=qlora with {engine}: the 4-bit weights must be stored in the dtype the engine "
                       f"flattens parameters to ({want} for precision={s.precision}), got "
                       f"quant_storage={s.quant_storage}; set quant_storage={want}")
        elif s.zero_stage == 3 and s.offload == "optimizer+params":
            out.append("method=qlora with ZeRO-3 parameter offload: DeepSpeed cannot offload bitsandbytes 4-bit "
                       "parameters; use fsdp=full_shard with offload=optimizer+params, or offload=optimizer")
        return out

    def load_kwargs(self, run: Any, compute_dtype: Any, engine: Any, local_rank: int, cuda: bool,
                    notes: list[str]) -> dict[str, Any]:
        import torch
        from transformers import BitsAndBytesConfig

        s = run.strategy
        if importlib.util.find_spec("bitsandbytes") is None:
            raise IncompatibleError("strategy.method=qlora needs bitsandbytes (pip install bitsandbytes) or "
                                    "use method=lora")
        storage = {"uint8": torch.uint8, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp32": torch.float32}[s.quant_storage]
        if not cuda:
            notes.append("qlora on CPU: bitsandbytes NF4 CPU kernels (slow, for testing the path)")
        kwargs: dict[str, Any] = {"quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=s.double_quant,
            bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=storage)}
        if cuda and not engine.flattens_parameters:
            # FSDP / ZeRO-3 place the shards themselves (rank-0 loading / zero.Init); no device_map
            kwargs["device_map"] = {"": local_rank}
        return kwargs

    def prepare_base(self, model: Any, run: Any, engine: Any) -> Any:
        if engine.flattens_parameters:
            # ZeRO-3 / FSDP flatten parameters of one dtype: no k-bit preparation (it upcasts norms and
            # embeddings to fp32), only what it would do that sharded QLoRA still needs
            if run.strategy.gradient_checkpointing:
                enable_checkpointing(model)
            model.enable_input_require_grads()
            return model
        from peft import prepare_model_for_kbit_training

        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=run.strategy.gradient_checkpointing,
                                               gradient_checkpointing_kwargs=GC_KWARGS)


METHOD = QLora()
