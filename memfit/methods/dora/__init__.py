"""DoRA (weight-decomposed LoRA, Liu et al. 2024): PEFT's ``LoraConfig(use_dora=True)``.

Each adapted linear gets a trained magnitude vector ``m`` (one value per output feature) and computes
(peft/tuners/lora/dora.py, ``DoraLinearLayer.forward``, peft 0.21)::

    mag_norm_scale = m / ||W + s·B·A||_c        (the norm detached: no gradient through it)
    result = base(x) + (mag_norm_scale - 1) * base_result + mag_norm_scale * B(A(x)) * s

What the estimator adds to LoRA's count (:meth:`extra_trainable_parameters`, :meth:`extra_saved_bytes`):

- the magnitudes: Σ out_features over the adapted linears, per layer; trained like the adapters;
- saved for backward per adapted linear, for every token: ``base_result`` (kept by the product with
  ``mag_norm_scale - 1``; vanilla LoRA lets the base output go after its add) and ``B(A(x))`` (kept by
  the product with ``mag_norm_scale``; vanilla LoRA only scales it by a constant);
- with ``lora_dropout > 0`` PEFT recomputes ``base_result = F.linear(dropout(x), W.to(x.dtype))``: where
  the input was cast to the fp32 adapters, the linear saves that cast copy of the base weight (autocast's
  16-bit copy of it under mixed precision) for the input gradient, once per adapted linear and layer.

Not counted: the forward's transients (an identity matrix in × in, ``B·A`` as a full out × in matrix, the
weight norm's temporaries), freed once each linear's forward returns.
"""

from __future__ import annotations

from typing import Any

from memfit.methods.lora import Lora


class Dora(Lora):
    name = "dora"
    family = "lora"   # LoRA's memory and time model, plus the two hooks below
    use_dora = True
    planned = False   # searched when asked for (--methods dora), not by default

    def extra_trainable_parameters(self, model: Any, targets: Any) -> int:
        return model.layers * sum(lin.out_features for lin in model.lora_linears(targets))

    def extra_saved_bytes(self, model: Any, strategy: Any, targets: Any, *, tokens: int, compute_bytes: float,
                          adapter_bytes: float, cast_bytes: float, layers: float) -> float:
        linears = model.lora_linears(targets)
        outs = sum(lin.out_features for lin in linears)
        if strategy.lora_dropout > 0:  # base_result recomputed from the dropped (cast) input
            base_b = adapter_bytes
            weights = cast_bytes * sum(lin.in_features * lin.out_features for lin in linears)
        else:
            base_b, weights = compute_bytes, 0.0
        return layers * (tokens * outs * (base_b + adapter_bytes) + weights)


METHOD = Dora()
