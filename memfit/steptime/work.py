"""What a decoder layer's work is, counted from transformers' and PEFT's code: the bytes its memory-bound
kernels move and the module-level ops its host dispatches. Device-independent: the CPU and GPU time models
both price these counts at their own speeds."""

from __future__ import annotations

from memfit.methods import METHODS
from memfit.methods.base import NO_WORK, LayerWork
from memfit.spec.model import ModelSpec

_PER_MODEL: dict = {}


def per_model(key: tuple, model: ModelSpec, compute):
    """``compute()`` cached per ``key`` for as long as ``model`` is the object it was computed for (plans
    estimate thousands of combinations of one model)."""
    hit = _PER_MODEL.get(key)
    if hit is None or hit[0] is not model:
        if len(_PER_MODEL) > 4096:
            _PER_MODEL.clear()
        hit = _PER_MODEL[key] = (model, compute())
    return hit[1]


def elementwise_bytes(model: ModelSpec, e: float) -> float:
    """Bytes read + written by one layer's memory-bound forward work per token, ``e`` bytes per value.

    RMSNorm (fp32 inside: upcast, square, mean, scale, downcast, weight: 28 + 4e per value), two residual
    adds (3 passes each), RoPE on q and k (~8 passes), q/k/v layout copies for attention and the output's
    (2 passes each), the gated activation silu(gate)·up (5 passes; 2 for a plain GELU MLP), GQA's
    repeat_kv copies (2 passes of k and v at the query width).
    """
    h, q, kv, ff = model.hidden, model.q_dim, model.kv_dim, model.intermediate
    norm = model.norms_per_layer * (28.0 + 4.0 * e) * h
    act = (5.0 if model.mlp in ("swiglu", "geglu") else 2.0) * e * ff
    repeat = 2.0 * e * 2 * q if model.kv_heads < model.heads else 0.0
    # a mixture's routing (transformers MixtralSparseMoeBlock.forward): per top-k copy of the token, its
    # gather into the expert's batch (2 passes of h), the routing-weight product (3) and index_add_ (3)
    route = 8.0 * e * h * model.experts_per_token if model.experts else 0.0
    return norm + 6.0 * e * h + 8.0 * e * (q + kv) + 2.0 * e * (q + 2 * kv) + 2.0 * e * q + act + repeat + route


def lora_elementwise_bytes(k: float, n: float, e: float, dropout: bool, cast: bool, gc: bool,
                           dropout_timed: bool = False) -> float:
    """Bytes per token one PEFT LoRA linear (k -> n) moves outside its matmuls, forward + backward
    (+ the recomputed forward), ``e`` bytes per value.

    peft/tuners/lora/layer.py ``Linear.forward`` (0.21): ``result + lora_B(lora_A(dropout(x))) * scaling``
    after ``_cast_input_dtype(x, lora_A.weight.dtype)``. Forward: the scale (read + write n) and the add
    (3 n); the input cast to the adapter's fp32 where the base runs in 16 bits (e + 4 per input value);
    dropout when p > 0 (its mask, read, write: 4 k). Backward: the scale's gradient (2 n), x's two gradients
    (base and adapter) summed (3 k), the cast back, dropout's mask product (3 k). ``dropout_timed``: its
    forward is timed per value apart (CPU: its random draws, ``Speeds.dropout_value``), not by its bytes.
    """
    c = (e + 4.0) * k if cast else 0.0
    d = 4.0 * e * k if dropout and not dropout_timed else 0.0
    forward = 5.0 * e * n + c + d
    backward = 2.0 * e * n + 3.0 * e * k + c + (3.0 * e * k if dropout else 0.0)
    return forward * (2.0 if gc else 1.0) + backward


def ops_per_layer(model: ModelSpec, adapted: int, eager: bool) -> float:
    """Module / function calls of one layer's forward (each with its backward): norms 7 each, 4 attention
    linears, RoPE ~12, attention 4 (eager 9), residuals 2, the MLP's linears + act + product, ~8 views;
    a LoRA-adapted linear adds dropout, A, B, scale, add, cast."""
    mlp = len(model.linears) - 4 + 2
    return model.norms_per_layer * 7 + 4 + 12 + (9 if eager else 4) + 2 + mlp + 8 + 6 * adapted


RECOMPUTE_DISPATCH = 0.4  # a recomputed layer forward costs this fraction of its forward + backward dispatch
# (the forward issues ~40 % of the ops of forward + backward: autograd's nodes mirror most forward ops)


def kbit_cast_bytes(model: ModelSpec, e: float) -> float:
    """Bytes per token and layer, forward, of bitsandbytes' casts around every ``Linear4bit`` of a model
    prepared by ``prepare_model_for_kbit_training`` (fp32 residual stream): its input to the compute dtype
    and its output back to the input's fp32 (bitsandbytes/nn/modules.py ``Linear4bit.forward``): (4 + e)
    per input and per output value; the backward casts the gradients the same way."""
    return per_model(("kbit", id(model), e), model, lambda: sum(
        (4.0 + e) * (x.in_features + x.out_features) * x.active * x.count for x in model.linears))


def elementwise_cached(model: ModelSpec, e: float) -> float:
    """:func:`elementwise_bytes`, cached per model and value size (plans estimate thousands of combinations)."""
    return per_model(("elementwise", id(model), e), model, lambda: elementwise_bytes(model, e))


def extra_work(model: ModelSpec, st, adapted: frozenset) -> LayerWork:
    """``Method.extra_layer_work`` of the run's method, called once per model, method and adapted set."""
    return per_model(("extra-work", id(model), st.method, getattr(st, "peft_config", None), adapted), model,
                     lambda: METHODS[st.method].extra_layer_work(model, st, adapted) if st.method in METHODS
                     else NO_WORK)


def method_work(model: ModelSpec, st, adapted: frozenset, gc: bool) -> tuple[float, float, float, float]:
    """The method's own work per layer and micro-batch beyond its family's (``Method.extra_layer_work``, e.g.
    DoRA's weight norm), for both time models: (bytes moved once per forward — twice under checkpointing —,
    bytes per token, host ops in forward + backward units, the size of one weight-sized transfer)."""
    def compute():
        w = extra_work(model, st, adapted)
        if w == NO_WORK:
            return 0.0, 0.0, 0.0, 0.0
        fwd = 2.0 if gc else 1.0
        ops = w.forward_ops * RECOMPUTE_DISPATCH * fwd + w.ops * (1.0 + (RECOMPUTE_DISPATCH if gc else 0.0))
        largest = max([4.0 * x.in_features * x.out_features for x in model.linears if x.name in adapted]
                      + [4.0 * d[0] * d[1] for d in w.delta_linears], default=1.0)
        e = 4.0 if st.precision == "fp32" else 2.0  # method=peft's wrapped linears: LoRA's elementwise work
        like = sum(share * lora_elementwise_bytes(k, n, e, w.dropout, e != 4.0, gc) for k, n, share in w.lora_like)
        return (w.weight_bytes * fwd, w.token_forward_bytes * fwd + w.token_backward_bytes + like, ops, largest)
    return per_model(("method-work", id(model), st.method, getattr(st, "peft_config", None), adapted, gc,
                      st.precision), model, compute)


def method_gemms(model: ModelSpec, st, adapted: frozenset) -> tuple[tuple, tuple]:
    """The method's own GEMMs per layer and micro-batch (``Method.extra_layer_work``): (``delta_linears``: a
    second linear per token, e.g. PEFT's LoHa applying its delta weight — (in, out, instances, in the adapter
    dtype, weight trains) —, ``weight_gemms``: products of weight-sized matrices whatever the tokens, e.g. BOFT's
    rotation — (m, n, k, forward, backward, instances))."""
    def compute():
        w = extra_work(model, st, adapted)
        return w.delta_linears, w.weight_gemms
    return per_model(("method-gemms", id(model), st.method, getattr(st, "peft_config", None), adapted), model,
                     compute)
