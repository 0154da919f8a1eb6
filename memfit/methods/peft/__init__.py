"""Any PEFT method from its own config (``method=peft``, a run file's ``peft_config:`` block or an
adapter_config.json): PEFT builds the adapter on a meta-device copy of the model to count the trained
parameters exactly and to name the modules it wraps (:mod:`~memfit.methods.peft.count`, torch imported
only then, the count cached); the bytes each wrapped module saves for backward follow the method's PEFT
layer code (:mod:`~memfit.methods.peft.saved`, each rule cited). Trained like the other adapters: fp32
adapter parameters (PEFT's ``autocast_adapter_dtype``) with their gradients and optimizer state, the base
frozen at 16 bits. The time model prices the base model's work, prompt learning's virtual tokens and the
delta-weight methods' second linear, BOFT's rotation, RandLoRA's and OSF's extra linears
(:meth:`Peft.extra_layer_work`); other adapters' own kernels are not timed.
"""

from __future__ import annotations

import json
import math
from typing import Any

from memfit.errors import ConfigError
from memfit.methods.base import AdapterMemory, Method, Parameters, enable_checkpointing
from memfit.methods.peft.count import counted, peft_config_object
from memfit.methods.peft.saved import DELTA_LINEAR_TYPES, adaption_prompt_bytes, saved_bytes


def adapter_count(model: Any, strategy: Any) -> dict:
    """PEFT's own count of ``strategy.peft_config`` on ``model`` (cached; see memfit.methods.peft.count)."""
    if not getattr(model, "config_json", ""):
        raise ConfigError(f"method=peft on {model.name}: no config.json to build the model from; give the model "
                          "as a preset, folder, config.json or Hub id")
    return counted(model.config_json, strategy.peft_config)


class Peft(Method):
    name = "peft"
    family = "lora"          # a frozen 16-bit base with fp32 adapters: LoRA's memory model, without its adapters
    fields = ("peft_config",)
    planned = False          # searched when asked for (--methods peft with a peft_config)
    fp32_adapters = True

    def parameters(self, model: Any, strategy: Any, profile: Any, numbers: Any, half: float) -> Parameters:
        c = adapter_count(model, strategy)
        # the adapter's frozen additions (VeRA's projections, OSF's SVD factors) beside the base, in its dtype
        return Parameters(float(c["trainable"]), (float(model.parameters) + c["frozen_added"]) * half)

    def extra_layer_work(self, model: Any, strategy: Any, adapted: Any) -> dict:
        """The PEFT layer's own GEMMs per decoder layer, for the time model, read from its ``forward`` (peft
        0.21.2):

        - the delta-weight methods (LoHa, LoKr, FourierFT, HiRA, WaveFT, PEANuT: saved.DELTA_LINEAR_TYPES)
          apply a weight-sized delta with a second ``F.linear(x, delta_w)`` beside the base layer, in the
          adapter dtype: ``delta_linears`` (in, out, instances per layer, True); the delta itself is written
          in the forward and its gradient written and read back into the factors' in the backward: 3 x 4 B per
          weight value (fp32 adapters);
        - BOFT (boft/layer.py ``Linear.forward``:594-650) rotates the input: it builds an in x in rotation from
          the butterfly blocks with ``bmm(block_diag, P.T)``, ``bmm(P, .)`` for each of the N butterfly
          factors, N - 1 chained products and ``@ eye`` (3N GEMMs of in x in x in, in the input's dtype; in
          backward 4N - 1, every product with a trained operand), then ``x @ boft_rotation`` (a linear of
          in x in whose weight trains): ``weight_gemms`` (m, n, k, forward, backward, instances per layer);
        - RandLoRA (randlora/layer.py ``forward``:327-344, ``get_scaled_bases``:262-308) adds
          ``F.linear(F.linear(x, first), second)`` of full rank R = r x ceil(min(in, out) / r) in the adapter
          dtype, its shared random bases frozen and only the basis on the smaller side scaled by the trained
          lambda / gamma: two more ``delta_linears``, one of them with a weight gradient;
        - OSF (osf/layer.py ``forward``:316-350) adds ``F.linear(F.linear(x, B), A)`` with A, B the trained
          low-rank factors concatenated with their frozen initial copies: rank 2r (r = the trained rank), in
          the adapter dtype, both weights carrying gradients.

        ``delta_linears`` entries: (in, out, instances per layer, in the adapter dtype, weight trains)."""
        c = adapter_count(model, strategy)
        wrapped = c["wrapped"]
        per_layer = [(float(w["in"]), float(w["out"]), w["count"] / model.layers) for w in wrapped
                     if w["type"] in DELTA_LINEAR_TYPES]
        out: dict = {}
        if per_layer:
            out["delta_linears"] = tuple((k, n, share, True, True) for k, n, share in per_layer)
            out["weight_bytes"] = sum(12.0 * k * n * share for k, n, share in per_layer)
        boft = [(float(w["in"]), w["count"] / model.layers) for w in wrapped if w["type"] == "boft.Linear"]
        if boft:
            factors = int(c["config"].get("boft_n_butterfly_factor") or 1)
            out["delta_linears"] = out.get("delta_linears", ()) + tuple((k, k, share, False, True) for k, share in boft)
            out["weight_gemms"] = tuple((k, k, k, 3.0 * factors, 4.0 * factors - 1.0, share) for k, share in boft)
        rand = [w for w in wrapped if w["type"] == "randlora.Linear"]
        if rand:
            r = int(c["config"]["r"])
            pairs = []
            for w in rand:
                k, n, share = float(w["in"]), float(w["out"]), w["count"] / model.layers
                rank = float(r * math.ceil(min(k, n) / r))
                pairs += [(k, rank, share, True, k <= n), (rank, n, share, True, k > n)]  # the scaled basis trains
            out["delta_linears"] = out.get("delta_linears", ()) + tuple(pairs)
        osf = [w for w in wrapped if w["type"] == "osf.Linear"]
        if osf:  # 2r from the trained count, as saved._osf reads it
            out["delta_linears"] = out.get("delta_linears", ()) + tuple(
                d for w in osf for two_r in (2.0 * w["params"] / max(1, w["count"]) / max(1, w["in"] + w["out"]),)
                for d in ((float(w["in"]), two_r, w["count"] / model.layers, True, True),
                          (two_r, float(w["out"]), w["count"] / model.layers, True, True)))
        return out

    def prompt_tokens(self, model: Any, strategy: Any) -> int:
        """Virtual tokens prompt tuning / P-tuning put before every sequence (peft_model.py's
        PeftModelForCausalLM.forward concatenates them to the input embeddings: every layer and the logits
        see seq_len + these); prefix tuning's are keys and values only (counted by the attention's KV)."""
        c = adapter_count(model, strategy)
        return c["virtual_tokens"] if c["peft_type"] in ("PROMPT_TUNING", "P_TUNING") else 0

    def adapter_memory(self, model: Any, strategy: Any, profile: Any, numbers: Any, params: Parameters, *,
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
