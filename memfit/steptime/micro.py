"""One micro-batch's forward + backward (+ recomputation) on one catalog GPU, from its parts:

* every linear's GEMMs at their shapes (memfit.steptime.gemm): the forward, the input gradient, the weight
  gradient when trained, the forward again under checkpointing; the output head likewise (never recomputed);
  a mixture's experts each over their share of the tokens;
* LoRA's rank-r products as the GEMMs they are (memory-bound at these shapes), in fp32 without autocast
  (PEFT keeps adapters in fp32; TF32 is off by default);
* attention (memfit.steptime.attention);
* memory-bound work: the bytes memfit.steptime.work counts, at the bandwidth of their transfer size;
* QLoRA: each Linear4bit use dequantises its NF4 weight (0.5 byte read + 2 written per value, plus the
  absmax) as its own kernel;
* the host (memfit.steptime.host): the micro-batch costs the longer of the device's time and the host's.
"""

from __future__ import annotations

from typing import Any

from memfit.methods import METHODS
from memfit.spec.model import ModelSpec
from memfit.steptime.attention import eager_seconds, fused_seconds
from memfit.steptime.gemm import gemm_seconds, linear_seconds
from memfit.steptime.host import host_seconds, zero3_hook_seconds
from memfit.steptime.rates import GpuRates
from memfit.steptime.work import (adapted_width, elementwise_cached, extra_work, kbit_cast_bytes, linear_area,
                                  lora_elementwise_bytes, method_gemms, method_kernels, method_work,
                                  per_model)

NF4_BYTES_PER_VALUE = 0.5 + 2.0 + 4.0 / 64  # packed codes read, bf16 written, fp32 absmax per 64-value block


def _linears(model: ModelSpec, tokens: float, g: GpuRates, e: float, full: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's linears over ``tokens`` (cached per model and shape)."""
    def compute():
        fwd = bwd = 0.0
        for x in model.linears:
            f, b = linear_seconds(tokens * x.active, x.in_features, x.out_features, g, full, e)
            fwd, bwd = fwd + x.count * f, bwd + x.count * b
        return fwd, bwd
    return per_model(("gpu-lin", id(model), tokens, g, e, full), model, compute)


def _adapters(model: ModelSpec, adapted: frozenset, r: int, tokens: float, g: GpuRates, fp32: bool) -> tuple:
    """(forward, backward) seconds of the LoRA products of one layer's adapted linears: x·A (k -> r), ·B
    (r -> n); backward their input and weight gradients."""
    def compute():
        e = 4.0 if fp32 else 2.0
        fwd = bwd = 0.0
        for x in model.linears:
            if x.name not in adapted:
                continue
            m = tokens * x.active
            fa, ba = linear_seconds(m, x.in_features, r, g, True, e, fp32)
            fb, bb = linear_seconds(m, r, x.out_features, g, True, e, fp32)
            fwd, bwd = fwd + x.count * (fa + fb), bwd + x.count * (ba + bb)
        return fwd, bwd
    return per_model(("gpu-ad", id(model), adapted, r, tokens, g, fp32), model, compute)


def _lora_bytes(model: ModelSpec, adapted: frozenset, se: float, dropout: bool, gc: bool) -> float:
    """Bytes per token one layer's LoRA linears move outside their matmuls (cached per model and shape)."""
    return per_model(("gpu-lora-b", id(model), adapted, se, dropout, gc), model, lambda: sum(
        x.count * x.active * lora_elementwise_bytes(x.in_features, x.out_features, se, dropout, se != 4.0, gc)
        for x in model.linears if x.name in adapted))


def _dequant(model: ModelSpec, g: GpuRates) -> float:
    """Seconds of one layer's NF4 dequantisations, once each (cached per model and GPU)."""
    def compute():
        total = 0.0
        for x in model.linears:
            nbytes = x.in_features * x.out_features * NF4_BYTES_PER_VALUE
            total += x.count * nbytes / g.bandwidth(nbytes)
        return total
    return per_model(("gpu-dequant", id(model), g), model, compute)


def micro_batch(model: ModelSpec, g: GpuRates, st: Any, e: float, full: bool, adapted: frozenset,
                meft_rows: float, router: float, fp32_stream: bool, profile, engine: str,
                grad_tensors: float = 0.0) -> dict[str, float]:
    s, b, gc = st.seq_len, st.micro_batch_size, st.gradient_checkpointing
    T, L, h = float(b) * s, model.layers, model.hidden
    lf, lb = _linears(model, T, g, e, full)
    dense_s = L * (lf * (2.0 if gc else 1.0) + lb)
    hf, hb = per_model(("gpu-head", id(model), T, g, e, full), model,
                       lambda: linear_seconds(T, h, model.vocab, g, full, e))
    # loss=chunked under DeepSpeed ZeRO-3 (partitioned head weight) recomputes each chunk's logits in the
    # backward (memfit.train.loss): one more head forward, and that chunk's forward passes over the logits
    redo_head = getattr(st, "loss", "standard") == "chunked" and engine == "zero3"
    dense_s += hf * (2.0 if redo_head else 1.0) + hb
    passes = (3.0 if full else 2.0) + (1.0 if gc else 0.0)
    dense = 2.0 * T * L * linear_area(model) * passes
    dense += 2.0 * T * h * model.vocab * ((3.0 if full else 2.0) + (1.0 if redo_head else 0.0))
    adapter_s = adapter = 0.0
    fp32_adapter = st.precision in ("bf16", "fp32")  # no autocast: PEFT's fp32 adapters multiply in fp32
    if adapted:
        af, ab = _adapters(model, adapted, st.lora_r, T, g, fp32_adapter)
        adapter_s = L * (af * (2.0 if gc else 1.0) + ab)
        adapter = 2.0 * T * st.lora_r * adapted_width(model, adapted) * (3.0 + (1.0 if gc else 0.0)) * L
    if meft_rows:  # every token meets the buffered keys and values: two (T x h)(h x rows)-shaped products, x3
        mf, mb = linear_seconds(T, h, meft_rows, g, True, e)
        adapter_s += 2.0 * L * (mf + mb)
        adapter += 12.0 * T * h * meft_rows * L + 6.0 * T * router
    linears, weight_gemms = method_gemms(model, st, adapted)
    for k, n, per_layer, adapter_dtype, trains in linears:  # e.g. LoHa's F.linear(x, delta_w), BOFT's x @ R
        f32 = fp32_adapter and adapter_dtype
        df, db = linear_seconds(T, k, n, g, trains, 4.0 if f32 else e, f32)
        adapter_s += L * per_layer * (df * (2.0 if gc else 1.0) + db)
        adapter += 2.0 * T * k * n * per_layer * L * ((3.0 if trains else 2.0) + (1.0 if gc else 0.0))
    for m_, n, k, fwd_n, bwd_n, per_layer in weight_gemms:  # e.g. BOFT's rotation, built every forward
        count = fwd_n * (2.0 if gc else 1.0) + bwd_n
        adapter_s += L * per_layer * count * gemm_seconds(m_, n, k, g, e)
        adapter += 2.0 * m_ * n * k * L * per_layer * count
    kf, kb = method_kernels(model, st, adapted)  # e.g. BOFT's per-block copies: a kernel's fixed time each
    adapter_s += L * (kf * (2.0 if gc else 1.0) + kb) * g.gemm_kernel_seconds
    heads, d = model.heads, model.head_dim
    attn = 4.0 * b * s * s * model.q_dim * L * (4.0 if gc else 3.0)
    redo = 1.0 + (profile.attention_forward_share if gc else 0.0)
    se = 4.0 if fp32_stream else e
    if st.attention == "eager":
        prod, scores = eager_seconds(b, heads, s, d, g, e, profile.eager_score_bytes)
        attn_s = L * (prod + scores) * redo
    else:
        attn_s = L * fused_seconds(b, heads, s, d, g, profile.mem_efficient_attention_fraction) * redo
    fwd = 1.0 + 2.0 + (1.0 if gc else 0.0)
    lora_b = _lora_bytes(model, adapted, se, st.lora_dropout > 0, gc)
    layer_bytes = T * (elementwise_cached(model, se) * fwd + lora_b)
    if fp32_stream and e != 4.0:
        layer_bytes += T * kbit_cast_bytes(model, e) * (3.0 if gc else 2.0)
    weight_b, token_b, extra_ops, size = method_work(model, st, adapted, gc)  # e.g. DoRA's weight norm
    mem_s = L * (layer_bytes + T * token_b) / g.bandwidth(T * h * se) + (L * weight_b / g.bandwidth(size)
                                                                         if weight_b else 0.0)
    loss_bytes = T * model.vocab * (10 * 4.0 + 2 * e) + T * model.norms_per_layer / 2 * (28.0 + 4.0 * e) * h * 3.0
    if redo_head:  # write, upcast, log-softmax of the recomputed chunk
        loss_bytes += T * model.vocab * (4 * 4.0 + e)
    if full:
        loss_bytes += 2.0 * 4.0 * model.vocab * h
    mem_s += loss_bytes / g.bandwidth(T * model.vocab * 4.0)
    dequant_s = 0.0
    qlora = METHODS[st.method].quantized
    if qlora:
        dequant_s = L * (3.0 if gc else 2.0) * _dequant(model, g)
    device = dense_s + adapter_s + attn_s + mem_s + dequant_s
    host = host_seconds(model, len(adapted), st.attention == "eager", gc, qlora, engine, profile, grad_tensors,
                        st.grad_accum) + L * extra_ops * profile.gpu_host_op_seconds
    serial = zero3_hook_seconds(model, gc, profile) if engine == "zero3" else 0.0
    serial += L * extra_work(model, st, adapted).sync_ops * profile.gpu_host_op_seconds  # e.g. FourierFT's uploads
    return {"seconds": max(device, host) + serial, "device_seconds": device, "matmul_seconds": dense_s + adapter_s,
            "attention_seconds": attn_s, "memory_bound_seconds": mem_s, "dequant_seconds": dequant_s,
            "dispatch_seconds": host + serial, "dense_flops": dense, "attention_flops": attn, "adapter_flops": adapter}
