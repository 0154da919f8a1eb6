"""The ops of one micro-batch (memfit.steptime.ops), built once per shape for every device: the decoder layers'
linears, the output head, the method's adapter products and its own work (``Method.extra_layer_work``), the
attention, the memory-bound kernels (memfit.steptime.work counts their bytes from transformers' and PEFT's
code), QLoRA's dequantisations, the loss, and the host's dispatch with the engine's hooks.

What each term is and where it comes from is said where it was counted (work.py, host.py, gemm.py); here the
terms become ops. The list holds per-token figures, so one list serves every length it is priced at.
"""

from __future__ import annotations

from typing import NamedTuple

from memfit.engines import EngineCost
from memfit.methods import METHODS
from memfit.spec.model import ModelSpec
from memfit.steptime.host import MODULES_PER_LAYER_EXTRA
from memfit.steptime.ops import (Attention, Bytes, Dequant, Dispatch, Dropout, EngineHooks, Exchange, Gemm, HostCopy,
                                 Kernels, Linear, Router, Sync, Tensors, Work)
from memfit.steptime.work import (RECOMPUTE_DISPATCH, elementwise_cached, extra_work, kbit_cast_bytes,
                                  lora_elementwise_bytes, method_gemms, method_work, ops_per_layer, per_model)


class Shape(NamedTuple):
    """What a micro-batch's ops depend on, besides the model (hashable: the ops are cached by all but its first
    two fields)."""

    batch: int
    seq: int
    recompute: bool           # gradient checkpointing
    eager: bool               # transformers' eager attention (else a fused kernel)
    e: float                  # bytes of a value in the compute dtype
    trains_base: bool         # the base weights get gradients (full fine-tuning)
    adapted: frozenset        # the LoRA-style adapted linears' names
    lora_r: int
    dropout: bool             # LoRA's dropout p > 0
    fp32_adapters: bool       # no autocast: PEFT's fp32 adapters multiply in fp32 (bf16 / fp32 precision)
    fp32_stream: bool         # QLoRA's fp32 residual stream (prepare_model_for_kbit_training)
    quantized: bool           # the frozen base is NF4 (bitsandbytes Linear4bit)
    meft_rows: float          # MEFT's buffered rows per layer
    router: float             # MEFT's router parameters
    chunked_loss: bool
    redo_head: bool           # the chunked loss recomputes each chunk's logits (DeepSpeed ZeRO-3's partitioned head)
    fsdp: bool                # the engine's hooks per wrapped unit (FSDP)
    zero_grad_hooks: float    # DeepSpeed ZeRO-1/2: trainable tensors whose gradient hooks run per micro-batch
    zero3_hooks: bool         # DeepSpeed ZeRO-3's fetch / release hooks
    method: str               # the run's method and PEFT config: its LayerWork (memfit.steptime.work.extra_work)
    peft_config: object
    precision: str
    sequence_parallel: int = 1  # Ulysses: ranks sharing each sequence (the shape is one rank's share)
    context_parallel: int = 1   # torch's context parallelism, likewise
    group_in_node: bool = True  # that group sits in one node
    offload_per_token: float = 0.0  # activations offloaded per local token (memfit.estimate.longctx)
    tiled_mlp: bool = False     # DeepSpeed's TiledMLP: the MLP's forward once more, in its backward
    flash_package: bool = False  # attention: fa2, the flash-attn 2 package's kernel (else SDPA's)

# the attention block's linears (any other decoder-layer linear is the MLP's: the tiled MLP recomputes those)
ATTENTION_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "query_key_value", "dense", "c_attn",
                               "attn.c_proj", "qkv_proj", "out_proj"})


def _method_ops(model: ModelSpec, sh: Shape, st) -> tuple[list, float]:
    """The method's own work beyond its family's (``Method.extra_layer_work``) as ops, and its host ops per layer."""
    L, h, gc = model.layers, model.hidden, sh.recompute
    f = 2.0 if gc else 1.0
    se = 4.0 if sh.fp32_stream else sh.e
    ops: list = []
    linears, weight_gemms = method_gemms(model, st, sh.adapted)
    for k, n, per_layer, adapter_dtype, trains in linears:  # e.g. LoHa's F.linear(x, delta_w), BOFT's x @ R
        f32 = sh.fp32_adapters and bool(adapter_dtype)
        ops.append(Linear(k, n, 1.0, L * per_layer, f, bool(trains), 4.0 if f32 else sh.e, f32, dense=False))
    for m_, n, k, fwd_n, bwd_n, per_layer in weight_gemms:  # e.g. BOFT's rotation, built every forward
        ops.append(Gemm(m_, n, k, L * per_layer * (fwd_n * f + bwd_n), sh.e))
    kf, kb = extra_work(model, st, sh.adapted).kernels  # e.g. BOFT's per-block copies
    if kf or kb:
        ops.append(Kernels(L * (kf * f + kb)))
    weight_b, token_b, extra_ops, size = method_work(model, st, sh.adapted, gc)  # e.g. DoRA's weight norm
    ops.append(Bytes(L * token_b, size_per_token=h * se))
    if weight_b:
        ops.append(Bytes(0.0, L * weight_b, size=size))
    sync = extra_work(model, st, sh.adapted).sync_ops  # e.g. FourierFT's uploads
    if sync:
        ops.append(Sync(L * sync))
    return ops, extra_ops


def _ops(model: ModelSpec, sh: Shape, st) -> tuple:
    L, h, V, gc, e = model.layers, model.hidden, model.vocab, sh.recompute, sh.e
    f = 2.0 if gc else 1.0
    se = 4.0 if sh.fp32_stream else e  # the values the layer's elementwise work moves
    ops: list = [Linear(x.in_features, x.out_features, x.active, L * x.count,
                        f + (1.0 if sh.tiled_mlp and x.name not in ATTENTION_LINEARS else 0.0), sh.trains_base, e)
                 for x in model.linears]
    ops.append(Linear(h, V, 1.0, 1.0, 2.0 if sh.redo_head else 1.0, sh.trains_base, e))  # the head, not recomputed
    shapes = tuple((x.in_features, x.out_features, x.count * x.active) for x in model.linears if x.name in sh.adapted)
    ea = 4.0 if sh.fp32_adapters else 2.0
    for x in model.linears:  # LoRA's x·A (k -> r) and ·B (r -> n)
        if x.name in sh.adapted:
            ops.append(Linear(x.in_features, sh.lora_r, x.active, L * x.count, f, True, ea, sh.fp32_adapters, True,
                              False))
            ops.append(Linear(sh.lora_r, x.out_features, x.active, L * x.count, f, True, ea, sh.fp32_adapters, True,
                              False))
    if sh.meft_rows:  # every token meets the buffered keys and values: two (T x h)(h x rows) products, not recomputed
        ops.append(Linear(h, sh.meft_rows, 1.0, 2.0 * L, 1.0, True, e, dense=False))
        ops.append(Router(sh.router))
    method, extra_ops = _method_ops(model, sh, st)
    ops += method
    context = sh.sequence_parallel * sh.context_parallel
    ops.append(Attention(model.heads, model.head_dim, model.q_dim, L, sh.eager, gc, e, context, sh.flash_package))
    ops += _sequence_ops(model, sh)
    fwd = 1.0 + 2.0 + (1.0 if gc else 0.0)  # forward, backward (x2), recomputation
    ops.append(Bytes(L * elementwise_cached(model, se) * fwd, size_per_token=h * se))
    if shapes:  # PEFT's LoRA linears outside their matmuls; their dropout's forward apart
        ops.append(Bytes(L * sum(w * lora_elementwise_bytes(k, n, se, sh.dropout, se != 4.0, gc, True)
                                 for k, n, w in shapes), size_per_token=h * se))
        if sh.dropout:
            ops.append(Dropout(L * sum(w * k for k, n, w in shapes) * f, se, h * se))
    if sh.fp32_stream and e != 4.0:  # the casts around each Linear4bit: forward, backward, recomputation
        ops.append(Bytes(L * kbit_cast_bytes(model, e) * (3.0 if gc else 2.0), size_per_token=h * se))
    # the final norm; the loss: upcast, log-softmax, gather, its gradient, cast; the recomputed chunk's forward
    # part again (write, upcast, log-softmax); full fine-tuning's dense embedding gradient (zeroed, scattered)
    loss = model.norms_per_layer / 2 * (28.0 + 4.0 * e) * h * 3.0 + V * (10 * 4.0 + 2 * e)
    loss += V * (4 * 4.0 + e) if sh.redo_head else 0.0
    ops.append(Bytes(loss, 2.0 * 4.0 * V * h if sh.trains_base else 0.0, size_per_token=V * 4.0))
    if sh.quantized:  # every copy dequantised per use: forward, input gradient, recomputation
        ops.append(Dequant(tuple((x.in_features, x.out_features, x.count) for x in model.linears),
                           3.0 if gc else 2.0, L))
    ops.append(Tensors(model.heads, V, model.intermediate, L, e, sh.eager, gc, sh.chunked_loss))
    base = ops_per_layer(model, 0, sh.eager)
    ops.append(Dispatch(L, base, ops_per_layer(model, len(sh.adapted), sh.eager) - base, len(sh.adapted), sh.eager,
                        gc, L * extra_ops, float(sum(x.count for x in model.linears)) if sh.quantized else 0.0))
    ops.append(_engine_hooks(model, sh))
    return tuple(ops)


def _sequence_ops(model: ModelSpec, sh: Shape) -> list:
    """The sequence group's collectives and the offloaded activations' copies (memfit.estimate.longctx says
    what each engine does): Ulysses' four all-to-alls per layer and pass (q, k, v, the output; their gradients
    in the backward), a KV head replicated where the group outnumbers them; context parallelism's all-gather
    of the whole sequence's keys and values per layer and pass, and the reduce-scatter of their gradients."""
    ops: list = []
    L, e, passes = model.layers, sh.e, 2.0 + (1.0 if sh.recompute else 0.0)
    if sh.sequence_parallel > 1:
        n = sh.sequence_parallel
        kv = max(model.kv_dim, model.head_dim * n) if n > model.kv_heads else model.kv_dim
        ops.append(Exchange("all_to_all", L * passes * (2 * model.q_dim + 2 * kv) * e, L * passes * 4.0, n,
                            sh.group_in_node))
    if sh.context_parallel > 1:
        n = sh.context_parallel
        ops.append(Exchange("all_gather", L * (passes + 1.0) * n * 2 * model.kv_dim * e, L * (passes + 1.0) * 2.0,
                            n, sh.group_in_node))
    if sh.offload_per_token:
        ops.append(HostCopy(sh.offload_per_token))
    return ops


def _engine_hooks(model: ModelSpec, sh: Shape) -> EngineHooks:
    """The engine's host work per micro-batch: FSDP's hooks per wrapped unit (decoder layers + the embedding +
    the tail), DeepSpeed ZeRO-1/2's gradient hooks per trainable tensor, ZeRO-3's fetch / release per submodule
    and pass (the recomputed forward's at its dispatch share)."""
    units = model.layers + 2.0 if sh.fsdp else 0.0
    modules = 0.0
    if sh.zero3_hooks:
        redo = 1.0 + (RECOMPUTE_DISPATCH if sh.recompute else 0.0)
        modules = (len(model.linears) + model.norms_per_layer + MODULES_PER_LAYER_EXTRA) * model.layers * redo
    return EngineHooks(units, sh.zero_grad_hooks, modules)


def micro_work(model: ModelSpec, sh: Shape, st) -> Work:
    """The micro-batch's :class:`Work` (its ops cached per model and shape; ``st``: the strategy, which the
    method's ``extra_layer_work`` reads)."""
    key = sh[2:]  # all but the batch and the length: the ops hold per-token figures
    ops = per_model(("ops", id(model)) + key, model, lambda: _ops(model, sh, st))
    return Work(sh.batch, sh.seq, ops, (id(model),) + key)


def shape_for(model: ModelSpec, st, e: float, adapted: frozenset, meft_rows: float, router: float,
              fp32_stream: bool, engine: EngineCost, grad_tensors: float, group_in_node: bool = True,
              offloaded: float = 0.0) -> Shape:
    """The micro-batch's :class:`Shape` from the strategy, the engine's record and what the memory side
    resolved. The engine's gradient hooks run per trainable tensor every micro-batch where it reduces every
    micro-batch (ZeRO-2), else once per step: a 1/accumulation share each (ZeRO-1)."""
    chunked = getattr(st, "loss", "standard") == "chunked"
    hooks = grad_tensors / (1.0 if engine.reduces_every_micro_batch else max(1, st.grad_accum)) \
        if engine.tensor_hooks else 0.0
    method = METHODS[st.method]
    return Shape(st.micro_batch_size, st.seq_len, st.gradient_checkpointing, st.attention == "eager", e,
                 method.trains_base, adapted, st.lora_r, st.lora_dropout > 0, st.precision in ("bf16", "fp32"),
                 fp32_stream, method.quantized, meft_rows, router, chunked,
                 chunked and engine.loss_recomputes_head and not st.liger,
                 engine.unit_hooks, hooks, engine.module_fetch_hooks, st.method, getattr(st, "peft_config", None),
                 st.precision, st.sequence_parallel, st.context_parallel, group_in_node,
                 offloaded / (float(st.micro_batch_size) * st.seq_len), st.tiled_mlp, st.attention == "fa2")
