"""One micro-batch at measured speeds (``memfit calibrate --hardware``: this CPU, or a calibrated GPU) or an
uncalibrated CPU's guess: linears at the GEMM rate of their width, attention at the measured curve, bytes at
the measured bandwidth, the measured dispatch; on a CPU its own mechanisms besides (first-touch page faults,
the flash kernel's blocks, dropout's draws: memfit.steptime.cpu). Catalog GPUs take memfit.steptime.micro.
"""

from __future__ import annotations

from typing import Any

from memfit.methods import METHODS
from memfit.spec.model import ModelSpec
from memfit.steptime.cpu import fresh_bytes, mmap_threshold
from memfit.steptime.speeds import Speeds
from memfit.steptime.work import (RECOMPUTE_DISPATCH, elementwise_cached, kbit_cast_bytes, lora_elementwise_bytes,
                                  method_gemms, method_work, ops_per_layer, per_model)

_SUMS: dict = {}


def dispatch_seconds(model: ModelSpec, sp: Speeds, adapted: int, eager: bool, gc: bool) -> float:
    """Host-side cost of one micro-batch's forward + backward: measured per transformers layer / PEFT
    adapter where calibrated, else op counts x the per-op cost."""
    L, redo = model.layers, 1.0 + (RECOMPUTE_DISPATCH if gc else 0.0)
    if sp.overheads is not None:
        layer, rest, adapter, eager_extra, gc_extra = sp.overheads
        per_layer = layer + adapted * adapter + (eager_extra if eager else 0.0)
        if gc and gc_extra is not None:  # measured: torch.utils.checkpoint's own cost + the recomputed layer
            return L * (per_layer + gc_extra + RECOMPUTE_DISPATCH * adapted * adapter) + rest
        return L * redo * per_layer + rest
    ops = ops_per_layer(model, adapted, eager) * L * redo + 20.0
    return ops * sp.op_seconds


def _adapted_shapes(model: ModelSpec, adapted: frozenset) -> tuple:
    """(in_features, out_features, copies x share of the tokens) of the adapted linears, in the model's
    order (cached); the last is 1 for a dense linear, top-k for a mixture's experts."""
    return per_model((id(model), adapted), model, lambda: tuple(
        (x.in_features, x.out_features, x.count * x.active) for x in model.linears if x.name in adapted))


def _head_rate(model: ModelSpec, sp: Speeds) -> float:
    """``sp.gemm(hidden, vocab)``: the output head's FLOP/s (cached per model and speeds)."""
    return per_model(("head", id(model), sp), model, lambda: sp.gemm(model.hidden, model.vocab))


def _linear_sums(model: ModelSpec, sp: Speeds, adapted: frozenset) -> tuple[float, float, float]:
    """(Σ k·n, Σ k·n / GEMM rate, Σ (k + n) of the adapted) over one layer's linears, each weighted by
    the tokens it sees per token (copies x share: a mixture's top-k experts, ``Linear.count x active``)
    (cached: plans estimate thousands of combinations)."""
    key = (id(model), sp, adapted)
    hit = _SUMS.get(key)
    if hit is None or hit[0] is not model:
        lins = model.linears
        hit = (model, (sum(x.in_features * x.out_features * x.count * x.active for x in lins),
                       sum(x.in_features * x.out_features * x.count * x.active
                           / sp.gemm(x.in_features, x.out_features) for x in lins),
                       sum((x.in_features + x.out_features) * x.count * x.active for x in lins if x.name in adapted)))
        if len(_SUMS) > 4096:
            _SUMS.clear()
        _SUMS[key] = hit
    return hit[1]


def _quantized_sums(model: ModelSpec) -> tuple[float, float]:
    """(Σ k·n over every copy, Linear4bit modules) of one layer: what QLoRA dequantises per use and calls
    (cached; transformers' mixtures call each expert per forward, all reached at b·s ≫ experts)."""
    return per_model(("nf4", id(model)), model, lambda: (
        float(sum(x.in_features * x.out_features * x.count for x in model.linears)),
        float(sum(x.count for x in model.linears))))


def micro_batch(model: ModelSpec, sp: Speeds, st: Any, e: float, full: bool, adapted: frozenset,
                meft_rows: float, router: float = 0.0, fp32_stream: bool = False) -> dict[str, float]:
    """Seconds and FLOPs of one micro-batch's forward + backward (+ recomputation) on one process.
    ``fp32_stream``: QLoRA after ``prepare_model_for_kbit_training`` — fp32 embeddings and norms make the
    residual stream and every Linear4bit output fp32 (memory side: memfit.estimate.activations), so the
    memory-bound work moves 4-byte values, plus the casts around each Linear4bit."""
    s, b, gc = st.seq_len, st.micro_batch_size, st.gradient_checkpointing
    T, L, r = float(b) * s, model.layers, st.lora_r
    passes = (3.0 if full else 2.0) + (1.0 if gc else 0.0)
    lin_area, lin_time, ad_width = _linear_sums(model, sp, adapted)
    dense = 2.0 * T * lin_area * passes * L
    dense_s = 2.0 * T * lin_time * passes * L
    adapter = 2.0 * T * r * ad_width * (3.0 + (1.0 if gc else 0.0)) * L
    adapter_s = adapter / sp.gemm_skinny
    head = 2.0 * T * model.hidden * model.vocab * (3.0 if full else 2.0)
    # loss=chunked (memfit.train.loss): the same head matmuls, chunk by chunk; the gradient ones (input and,
    # when the head trains, weight) run in the forward instead of the backward, nothing is recomputed. Under
    # DeepSpeed ZeRO-3 (partitioned head weight) the loss takes its recomputing path: one more head forward
    recompute = getattr(st, "loss", "standard") == "chunked" and getattr(st, "engine", "") == "zero3"
    if recompute:
        head += 2.0 * T * model.hidden * model.vocab
    dense, dense_s = dense + head, dense_s + head / _head_rate(model, sp)
    if meft_rows:  # every token meets the buffered rows of keys and values: 2·h·rows each, x3 with backward
        fm = 12.0 * T * model.hidden * meft_rows * L
        fr = 6.0 * T * router  # MEFT's router (h x experts per layer), trained like any parameter
        adapter, adapter_s = adapter + fm + fr, adapter_s + fm / sp.gemm(model.hidden, meft_rows) + fr / sp.gemm_skinny
    linears, weight_gemms = method_gemms(model, st, adapted)
    for k, n, per_layer, _, trains in linears:  # e.g. PEFT's LoHa: F.linear(x, delta_w); BOFT's x @ rotation
        fd = 2.0 * T * k * n * per_layer * L * ((3.0 if trains else 2.0) + (1.0 if gc else 0.0))
        adapter, adapter_s = adapter + fd, adapter_s + fd / sp.gemm(k, n)
    for m_, n, k, fwd_n, bwd_n, per_layer in weight_gemms:  # e.g. BOFT's rotation, built every forward
        fw = 2.0 * m_ * n * k * L * per_layer * (fwd_n * (2.0 if gc else 1.0) + bwd_n)
        adapter, adapter_s = adapter + fw, adapter_s + fw / sp.gemm(k, n)
    attn = 4.0 * b * s * s * model.q_dim * L * (4.0 if gc else 3.0)
    fwd = 1.0 + 2.0 + (1.0 if gc else 0.0)  # forward, backward (x2), recomputation
    se = 4.0 if fp32_stream else e  # the values the layer's elementwise work moves
    shapes = _adapted_shapes(model, adapted)
    timed_drop = st.lora_dropout > 0 and sp.dropout_value > 0  # CPU: a random draw per value (measured)
    lora_bytes = sum(w * lora_elementwise_bytes(k, n, se, st.lora_dropout > 0, se != 4.0, gc, timed_drop)
                     for k, n, w in shapes)
    # PEFT's lora_dropout on each adapted linear's input (its own module: q, k and v draw apart), forward and
    # recomputed forward
    drop_values = T * L * sum(w * k for k, n, w in shapes) * (2.0 if gc else 1.0) if timed_drop else 0.0
    drop_s = drop_values * sp.dropout_value
    weight_b, token_b, extra_ops, _ = method_work(model, st, adapted, gc)  # e.g. DoRA's weight norm
    mem = T * L * (elementwise_cached(model, se) * fwd + lora_bytes + token_b) + L * weight_b
    if fp32_stream and e != 4.0:  # forward, backward (the gradients' casts), recomputation
        mem += T * L * kbit_cast_bytes(model, e) * (3.0 if gc else 2.0)
    mem += T * (model.norms_per_layer / 2 * (28.0 + 4.0 * e) * model.hidden) * 3.0  # final norm
    # loss: upcast, log-softmax, gather, its gradient, cast (the chunked loss's in-forward softmax − one-hot
    # makes the same passes over each chunk)
    mem += T * model.vocab * (10 * 4.0 + 2 * e)
    if recompute:  # the recomputed chunk's forward part of the loss again: write, upcast, log-softmax
        mem += T * model.vocab * (4 * 4.0 + e)
    if full:  # the embedding's dense gradient: zeroed and scattered into
        mem += 2.0 * 4.0 * model.vocab * model.hidden
    dequant = calls = 0.0
    if METHODS[st.method].quantized:  # every copy dequantised per use (forward, input gradient, recomputation)
        area, calls = _quantized_sums(model)
        dequant = area * L * (3.0 if gc else 2.0)
    # forward + backward at the measured rate, + the forward again under checkpointing at its measured share
    attn_fb = 12.0 * b * s * s * model.q_dim * L
    if st.attention == "eager" and sp.eager_bmm:  # its products + the work on the b·H·s² scores, measured apart
        scores = float(b) * model.heads * s * s
        bmm = sp.eager_bmm_rate(model.head_dim)
        attn_s = attn_fb / bmm * (1.0 + (1.0 / 3.0 if gc else 0.0)) + L * scores * sp.score_seconds(
            scores * e) * (1.0 + (sp.eager_scores_forward_share if gc else 0.0))
    else:
        attn_s = attn_fb / sp.attention_rate(s, model.head_dim) * (1.0 + (sp.attention_forward_share if gc else 0.0))
    faults = 0.0
    if sp.first_touch:  # CPU: tensors above glibc's mmap threshold are new pages each time (memfit.steptime.cpu)
        faults = sp.first_touch * fresh_bytes(b, s, model.heads, model.vocab, model.intermediate, L, e,
                                              st.attention == "eager", gc, getattr(st, "loss", "") == "chunked",
                                              mmap_threshold())
    # + each Linear4bit call's own cost (forward + input gradient; the forward again under checkpointing):
    # host work (bitsandbytes' Python and quant-state handling), so on a GPU it joins the dispatch
    calls_s = sp.dequant_call * L * calls * (1.5 if gc else 1.0)
    dequant_s = dequant / sp.dequant + (0.0 if sp.overlap_dispatch else calls_s)
    compute = dense_s + adapter_s + attn_s + mem / sp.bandwidth + dequant_s + faults + drop_s
    dispatch = dispatch_seconds(model, sp, len(adapted), st.attention == "eager", gc) + L * extra_ops * sp.op_seconds
    dispatch += calls_s if sp.overlap_dispatch else 0.0
    return {"seconds": max(compute, dispatch) if sp.overlap_dispatch else compute + dispatch,
            "matmul_seconds": dense_s + adapter_s, "attention_seconds": attn_s,
            "memory_bound_seconds": mem / sp.bandwidth + faults + drop_s, "dequant_seconds": dequant_s,
            "dispatch_seconds": dispatch, "dense_flops": dense, "attention_flops": attn, "adapter_flops": adapter}
