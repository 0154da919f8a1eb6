"""What the forward saves for backward, per GPU: activations, logits, and the method's own tensors."""

from __future__ import annotations

from typing import NamedTuple

from memfit.estimate import activations as A
from memfit.estimate import memory as M
from memfit.estimate.setup import Setup
from memfit.methods.base import AdapterMemory, Parameters


class Saved(NamedTuple):
    act_in: float           # the layers' inputs (kept by checkpointing)
    act_layers: float       # what the layers save inside (freed by checkpointing, one layer recomputed)
    act_tail: float         # after the last layer: final norm, the head's input
    act_bwd: float          # one layer's backward working memory
    act_fwd: float          # held at the forward's end (final norm output, KV cache)
    logits: float
    autocast: bool          # torch autocast on fp32 weights: fp32 residual stream
    adapter: AdapterMemory  # the method's own tensors (memfit.methods)
    head_grad: float = 0.0  # loss=chunked, fused, full fine-tuning: the head's gradient made in the forward
    fused: bool = False     # loss=chunked on the fused path (its gradients made in the forward)


def saved_tensors(run: Setup, params: Parameters, attention: str) -> Saved:
    model, st, p = run.model, run.strategy, run.profile
    s, b, gc, e = st.seq_len, st.micro_batch_size, run.gc, run.value_b
    s += run.method.prompt_tokens(model, st)  # method=peft's prompt tuning: virtual tokens in front
    fp32_stream, adapted = params.fp32_stream, params.adapted
    # fp32 adapters on a 16-bit base: PEFT casts lora_A's input to fp32; lora_A saves that copy in pure
    # bf16, or autocast's 16-bit copy of it under mixed precision (traced). In fp32, and where the engine
    # holds the adapters in 16-bit (DeepSpeed, FSDP), lora_A reads the base linear's input.
    cast_copy = (4.0 if run.precision == "bf16" else 2.0) if run.fp32_adapters and run.engine.autocast else 0.0
    # torch autocast on fp32 weights (full fine-tuning under plain DDP, as the HF Trainer runs it): fp32
    # residual stream, every linear casts its input to 16-bit itself. Adapter methods load the base in
    # 16-bit and DeepSpeed / FSDP's MixedPrecision hold 16-bit parameters: 16-bit activations.
    autocast = run.precision.endswith("-mixed") and run.engine.autocast and run.method.trains_base
    # dropout runs after PEFT's fp32 cast; on CPU its mask is a noise tensor of that dtype, CUDA's fused
    # kernel keeps 1 byte
    mask_b = (4.0 if cast_copy else e) if run.gpu.is_cpu else 1.0
    # backward through a cast adapter path: the gradient of lora_A's cast input, at its widest; what the
    # adapters after the attention save is freed before the attention's backward
    widest, after_attn_linears, _ = run.numbers.adapted_linears(adapted)
    dropout_copy_b = ((cast_copy or e) + mask_b) if st.lora_dropout > 0 else cast_copy
    rank_b = 4.0 if cast_copy == 4.0 else e
    after_attn = sum((dropout_copy_b * in_features + rank_b * st.lora_r) * count * active
                     for in_features, count, active in after_attn_linears)
    act_in, act_layers, act_tail, act_bwd = A.activation_parts(
        model, s, b, e, attention, gc, p, trained=run.method.trains_base, adapted=adapted,
        shares=st.lora_dropout == 0 and not cast_copy, autocast=autocast, adapter_grad=cast_copy * widest,
        adapter_mlp_side=after_attn, fp32_stream=fp32_stream, liger=st.liger,
        mlp_shards=max(1, -(-s // model.hidden)) if st.tiled_mlp else 1)
    # at the end of the forward the model still holds the final norm's output, and its KV cache (use_cache:
    # what the trainer leaves on unless checkpointing turns it off): under autocast RoPE promotes k to
    # fp32 while SDPA saves its own 16-bit copy, elsewhere the cache shares what attention saves
    residual_b = 4.0 if (e == 4.0 or autocast or fp32_stream) else e
    if fp32_stream:  # the fp32 head under autocast: its 16-bit weight copy is saved for the input's gradient
        act_tail += (model.head_parameters or model.embedding_parameters) * e * p.activation_scale
    act_fwd = float(b) * s * (residual_b * model.hidden
                              + (model.layers * model.kv_dim * 4.0 if autocast and not gc else 0.0))
    act_fwd *= 0.0 if p.activation_korthikanti else p.activation_scale
    # loss=chunked: the fused path (gradients made in the forward) except memfit's own under DeepSpeed ZeRO-3,
    # whose partitioned head weight only the module call gathers (the recomputing path); Liger's always fuses
    fused = st.loss == "chunked" and (st.liger or not run.engine.loss_recomputes_head)
    logits = M.logits_bytes(model, s, b, run.precision, p, st.loss, fused, st.liger)
    head_grad = 0.0
    if st.loss == "chunked":  # + the hidden-state gradients the loss makes in the forward, held for backward
        logits += float(b) * s * model.hidden * residual_b
        # full fine-tuning: + the head weight's gradient, accumulated over the chunks in the forward and held
        # until backward hands it to .grad (the fused path; under DeepSpeed ZeRO-3 the loss recomputes
        # instead and makes it in backward). In the weight's dtype: fp32 under DDP's autocast, FSDP's
        # unsharded compute dtype, ZeRO-1/2's 16-bit module weights
        if run.method.trains_base and fused:
            grad_b = run.grad_b if run.engine.autocast else min(run.grad_b, e)
            head_grad = float(model.head_parameters or model.embedding_parameters) * grad_b
            logits += head_grad
    adapter = run.method.adapter_memory(model, st, p, run.numbers, params, compute_bytes=e, cast_bytes=cast_copy,
                                        mask_bytes=mask_b, rank_bytes=rank_b, on_cpu=run.gpu.is_cpu)
    return Saved(act_in, act_layers, act_tail, act_bwd, act_fwd, logits, autocast, adapter, head_grad, fused)
