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

Time (:meth:`extra_layer_work`, memfit.steptime prices it): every forward of every adapted linear k -> n
rebuilds ``B·A`` and the weight norm — ``torch.eye(k)`` in the adapters' dtype (4k² bytes written),
``lora_A(eye)`` (reads it, writes k x r), ``lora_B`` of that (writes the k x n ``lora_weight``), the base weight
cast to the input's dtype (``weight.to(x.dtype)``: 2 read + 4 written per value where the adapters are fp32),
``get_weight_norm``'s ``scaling * lora_weight`` (8), ``weight + ...`` (12) and ``torch.linalg.norm(dim=1)``
(4): 8k² + 34kn bytes (products of rank r at fp32: memory-bound, priced by their bytes). Per token, in the
adapters' dtype a: ``(mag_norm_scale - 1) * base_result``, ``mag_norm_scale * lora_result * scaling`` and their
sum, forward 26n bytes (2 + 4 + 8 + 12 per value with a 16-bit base output); backward the gradients of those
products and the magnitude's reductions over the tokens, 48n. Host: ~16 more ops per adapted linear's
forward, 10 forward-only (eye, the two products, the casts, the norm, detach, the division, views) and 6
with a backward (the scale, the three products, the sum).

Not counted: the forward's transients (an identity matrix in × in, ``B·A`` as a full out × in matrix, the
weight norm's temporaries), freed once each linear's forward returns.
"""

from __future__ import annotations

from memfit.methods.base import LayerWork
from memfit.methods.lora import Lora
from memfit.methods.types import ModelLike, StrategyLike


class Dora(Lora):
    name = "dora"
    family = "lora"   # LoRA's memory and time model, plus the two hooks below
    use_dora = True
    planned = False   # searched when asked for (--methods dora), not by default

    def extra_trainable_parameters(self, model: ModelLike, targets: tuple) -> int:
        return model.layers * sum(lin.out_features for lin in model.lora_linears(targets))

    def extra_saved_bytes(self, model: ModelLike, strategy: StrategyLike, targets: tuple, *, tokens: int,
                          compute_bytes: float,
                          adapter_bytes: float, cast_bytes: float, layers: float) -> float:
        linears = model.lora_linears(targets)
        outs = sum(lin.out_features for lin in linears)
        if strategy.lora_dropout > 0:  # base_result recomputed from the dropped (cast) input
            base_b = adapter_bytes
            weights = cast_bytes * sum(lin.in_features * lin.out_features for lin in linears)
        else:
            base_b, weights = compute_bytes, 0.0
        return layers * (tokens * outs * (base_b + adapter_bytes) + weights)


    def extra_layer_work(self, model: ModelLike, strategy: StrategyLike, adapted: frozenset) -> LayerWork:
        a = 4.0  # PEFT keeps the adapters in fp32 (autocast_adapter_dtype) and casts the input to them
        linears = [x for x in model.linears if x.name in adapted]
        return LayerWork(weight_bytes=sum(x.count * (2.0 * a * x.in_features ** 2 + (8.0 * a + 2.0) * x.in_features
                                                     * x.out_features) for x in linears),
                         token_forward_bytes=sum(x.count * x.active * 26.0 * x.out_features for x in linears),
                         token_backward_bytes=sum(x.count * x.active * 48.0 * x.out_features for x in linears),
                         forward_ops=10.0 * sum(x.count for x in linears), ops=6.0 * sum(x.count for x in linears))


METHOD = Dora()
