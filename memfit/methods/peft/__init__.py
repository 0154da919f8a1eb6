"""Any PEFT method from its own config (``method=peft``, a run file's ``peft_config:`` block or an
adapter_config.json): PEFT builds the adapter on a meta-device copy of the model to count the trained
parameters exactly and to name the modules it wraps (:mod:`~memfit.methods.peft.count`, torch imported
only then, the count cached); the bytes each wrapped module saves for backward follow the method's PEFT
layer code (:mod:`~memfit.methods.peft.saved`, each rule cited). Trained like the other adapters: fp32
adapter parameters (PEFT's ``autocast_adapter_dtype``) with their gradients and optimizer state, the base
frozen at 16 bits. The time model prices the base model's work, prompt learning's virtual tokens and the
delta-weight methods' second linear, BOFT's rotation, RandLoRA's and OSF's extra linears, and every wrapped
linear's LoRA-like cast, dropout and add (:meth:`Peft.extra_layer_work`); other adapters' own kernels are not
timed.
"""

from __future__ import annotations

import json
from typing import Any

from memfit.errors import ConfigError
from memfit.methods.base import AdapterMemory, LayerWork, Method, Parameters, enable_checkpointing
from memfit.methods.peft.count import counted, peft_config_object
from memfit.methods.peft.saved import adaption_prompt_bytes, saved_bytes
from memfit.methods.peft.work import layer_work
from memfit.methods.peft.config import PeftSettings
from memfit.methods.types import ModelLike, NumbersLike, ProfileLike, StrategyLike


def adapter_count(model: Any, strategy: Any) -> dict:
    """PEFT's own count of ``strategy.peft_config`` on ``model`` (cached; see memfit.methods.peft.count)."""
    if not getattr(model, "config_json", ""):
        raise ConfigError(f"method=peft on {model.name}: no config.json to build the model from; give the model "
                          "as a preset, folder, config.json or Hub id")
    return counted(model.config_json, strategy.peft_config)


class Peft(Method):
    name = "peft"
    family = "lora"          # a frozen 16-bit base with fp32 adapters: LoRA's memory model, without its adapters
    fields = tuple(PeftSettings.model_fields)  # memfit/methods/peft/config.py
    planned = False          # searched when asked for (--methods peft with a peft_config)
    fp32_adapters = True

    def parameters(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                   half: float) -> Parameters:
        c = adapter_count(model, strategy)
        # the adapter's frozen additions (VeRA's projections, OSF's SVD factors) beside the base, in its dtype
        return Parameters(float(c["trainable"]), (float(model.parameters) + c["frozen_added"]) * half)

    def extra_layer_work(self, model: ModelLike, strategy: StrategyLike, adapted: frozenset) -> LayerWork:
        """The PEFT layer's own GEMMs per decoder layer, for the time model (rules per layer type, read from
        PEFT's code: :mod:`~memfit.methods.peft.work`)."""
        return layer_work(adapter_count(model, strategy), model)

    def prompt_tokens(self, model: ModelLike, strategy: StrategyLike) -> int:
        """Virtual tokens prompt tuning / P-tuning put before every sequence (peft_model.py's
        PeftModelForCausalLM.forward concatenates them to the input embeddings: every layer and the logits
        see seq_len + these); prefix tuning's are keys and values only (counted by the attention's KV)."""
        c = adapter_count(model, strategy)
        return c["virtual_tokens"] if c["peft_type"] in ("PROMPT_TUNING", "P_TUNING") else 0

    def adapter_memory(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                       params: Parameters, *,
                       compute_bytes: float, cast_bytes: float, mask_bytes: float, rank_bytes: float,
                       on_cpu: bool) -> AdapterMemory:
        c = adapter_count(model, strategy)
        st = strategy
        layers = profile.checkpoint_extra_layers if st.gradient_checkpointing else model.layers
        per_token, per_layer = saved_bytes(c, model, compute_bytes=compute_bytes,
                                           adapter_bytes=rank_bytes, cast_bytes=cast_bytes)
        tokens = float(st.micro_batch_size) * st.seq_len
        saved = (tokens * per_token + per_layer) * layers
        if c["peft_type"] == "ADAPTION_PROMPT":
            per, adapted = adaption_prompt_bytes(c["config"], model, compute_bytes)
            saved += tokens * per * (min(adapted, layers) if st.gradient_checkpointing else adapted)
        return AdapterMemory(intermediates=saved)

    def rules(self, model: Any, hardware: Any, strategy: Any) -> list[str]:
        try:
            c = adapter_count(model, strategy)
        except ConfigError as err:
            return [str(err)]
        if not c["trainable"]:
            return [f"peft_config ({c['peft_type']}) trains no parameter of {model.name}: check target_modules"]
        return []

    # ---------------------------------------------------------------- training
    def build(self, model: Any, run: Any, engine: Any) -> tuple[Any, list[str]]:
        from peft import get_peft_model

        if run.strategy.gradient_checkpointing:
            enable_checkpointing(model)
            model.enable_input_require_grads()
        cfg = peft_config_object(json.loads(run.strategy.peft_config))
        targets = getattr(cfg, "target_modules", None) or []
        targets = [targets] if isinstance(targets, str) else sorted(targets)
        return get_peft_model(model, cfg), targets

    def load(self, base_model: Any, folder) -> Any:
        from peft import PeftModel

        return PeftModel.from_pretrained(base_model, str(folder))


METHOD = Peft()
