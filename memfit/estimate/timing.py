"""Time of one optimizer step (= grad_accum micro-batches on every GPU / process), built from its parts.

Per micro-batch of T = b·s tokens, each part at the speed that bounds it (memfit.estimate.speeds):

* **matmuls** — every linear, 2·T·k·n FLOPs forward, + the input gradient, + the weight gradient if it is
  trained, + one more forward under checkpointing, at the GEMM rate of its width (LoRA's rank-r products at
  the skinny rate); the output head likewise (never recomputed);
* **attention** — 12·b·H·s²·d FLOPs forward + backward (+4 with recomputation) at the attention kind's rate;
* **memory-bound work** — norms, residual adds, RoPE, the MLP activation, layout copies, LoRA's dropout /
  casts, the loss over b·s·V logits: bytes read + written (counted from transformers' Llama code) at the
  measured bandwidth, ×3 with backward (+1 forward with recomputation);
* **dispatch** — ~one small-op cost per module call (forward + backward); on GPUs it overlaps the kernels
  (a micro-batch costs the larger of the two), on a CPU it adds;
* **QLoRA** — NF4 dequantisation of every frozen linear per use (forward, input gradient, recomputation).

Per step: the optimizer (AdamW per parameter and per tensor), gradient clipping and accumulation, the
engine's collectives (bytes per GPU of its ring collectives, latency per call) less what overlaps, offload
traffic and the CPU optimizer, MEFT's transfers and CPU search, and the Trainer's own loop.
"""

from __future__ import annotations

import math
from typing import Any

from memfit.estimate.constants import Profile
from memfit.estimate.engine_host import engine_host_seconds
from memfit.estimate.faults import fresh_bytes, mmap_threshold, step_fresh_bytes
from memfit.estimate.loop import optimizer_seconds, trainer_loop_ops
from memfit.estimate.speeds import Speeds, speeds_for
from memfit.spec.hardware import HardwareSpec
from memfit.spec.model import ModelSpec
from memfit.steptime.host import step_host_seconds
from memfit.steptime.micro import micro_batch as gpu_micro_batch
from memfit.steptime.work import (RECOMPUTE_DISPATCH, elementwise_bytes, kbit_cast_bytes,  # noqa: F401
                                   lora_elementwise_bytes, ops_per_layer, per_model)

_SUMS: dict = {}

BUCKET_BYTES = 25e6  # DDP's bucket_cap_mb (25) and the order of DeepSpeed's reduce buckets: one call each


def comm_parts(engine_kind: str, p_all: float, weight_bytes_all: float, p_t: float, g_b: float, w_b: float,
               ga: int, checkpointing: bool, fsdp: bool = False) -> dict[str, float]:
    """Bytes per optimizer step each GPU's collectives move, by primitive (bus convention: an all-reduce of
    S bytes counts 2·S, an all-gather its gathered output, a reduce-scatter its full input).

    ddp: all-reduce of trainable grads at the step. zero1 / zero2: DeepSpeed (0.19.8,
    runtime/zero/stage_1_and_2.py ``average_tensor``) reduces each gradient bucket with an **all-reduce**
    (``use_multi_rank_bucket_allreduce`` defaults to True, zero/config.py), then keeps its partition: at the
    step (zero1) or every micro-batch (zero2), + the all-gather of the updated params at the step
    (runtime/utils.py ``all_gather_into_tensor_dp_groups``). shard_grad_op: reduce-scatter every micro-batch
    and gathers all params once per micro-batch. zero3/full_shard: every micro-batch gathers all weights in
    forward and again in backward (ZeRO-3: and in recomputation; FSDP2's recomputes under the backward's
    gather, counted: 6 + 5 per step as without) + reduce-scatters grads (FSDP2: _fully_shard/_fsdp_collectives.py)."""
    if engine_kind == "ddp":
        return {"all_reduce": 2.0 * p_t * g_b}
    if engine_kind in ("zero1", "zero2"):
        return {"all_reduce": (ga if engine_kind == "zero2" else 1) * 2.0 * p_t * g_b, "all_gather": p_t * w_b}
    if engine_kind == "sgo":
        return {"reduce_scatter": ga * p_t * g_b, "all_gather": ga * weight_bytes_all}
    gathers = 3.0 if checkpointing and not fsdp else 2.0
    return {"all_gather": ga * gathers * weight_bytes_all, "reduce_scatter": ga * p_t * g_b}


def collective_calls(engine_kind: str, layers: int, nbytes: float, ga: int, checkpointing: bool,
                     tensors: float = 0.0, p_t: float = 0.0, reduce_bucket: float = 0.0, fsdp: bool = False) -> float:
    """Collective launches per step: one per bucket, and per layer for the sharded engines' gathers.

    DeepSpeed ZeRO-1/2 (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads`` /
    ``allreduce_and_scatter``) flushes its gradient bucket of ``reduce_bucket_size`` elements (memfit's
    default h², HF's 'auto') and all-reduces slices of at most one bucket, a parameter larger than the
    bucket alone: min(trainable tensors, P_t / bucket) all-reduces per reduction (counted on a 2-rank gloo
    run of a 39-tensor h-256 Llama: 37-41 per step), + the all-gather of the updated parameters. FSDP2, L + 2
    groups as accelerate wraps (fsdp_utils.py: layers, input embedding, [norm, lm_head]): per micro-batch a
    gather per group, again in backward but the tail's (full_shard), a reduce-scatter per group (11 + 6)."""
    if fsdp and engine_kind in ("zero3", "sgo"):
        groups = layers + 2
        return float(ga * (groups + (groups - 1 if engine_kind == "zero3" else 0) + groups))
    if engine_kind in ("zero1", "zero2") and reduce_bucket > 0 and tensors > 0:
        per = min(tensors, math.ceil(p_t / reduce_bucket))
        return float((ga if engine_kind == "zero2" else 1) * per + 1)
    calls = math.ceil(nbytes / BUCKET_BYTES) if nbytes > 0 else 0
    if engine_kind == "zero3":
        calls += ga * layers * (4 if checkpointing else 3)
    elif engine_kind in ("zero2", "sgo"):
        calls += ga * layers
    return float(calls)


def overlap_for(engine_kind: str, profile: Profile, cpu: bool = False) -> float:
    """The share of the micro-batches' device time behind which the engine's collectives can run (GPUs), or
    the share of them hidden (CPU processes: none, gloo shares the cores)."""
    if cpu:
        return profile.overlap_cpu_comm
    if engine_kind == "ddp":
        return profile.overlap_ddp
    if engine_kind in ("zero1", "zero2", "sgo"):
        return profile.overlap_zero12
    return profile.overlap_zero3


def exposed_comm(comm_s: float, device_s: float, engine_kind: str, profile: Profile, cpu: bool, layers: int) -> float:
    """Collective seconds the step waits for. CPU processes: all but the hidden share. GPUs: NCCL runs on its
    own streams beside the kernels, so the collectives hide behind up to ``overlap_for`` of the device's
    compute (DDP's bucketed all-reduce behind the backward; FSDP / ZeRO-3's prefetched gathers behind forward
    and backward), and at least one layer's worth (the first gather, the last reduction) is exposed. A hidden
    collective still slows the kernels beside it (``comm_overlap_tax`` of its time: NCCL's channels are thread
    blocks on the SMs, and they stream through the same HBM)."""
    if cpu or device_s <= 0.0:
        return comm_s * (1.0 - overlap_for(engine_kind, profile, cpu))
    window = overlap_for(engine_kind, profile) * device_s
    hidden = min(comm_s, window)
    return max(comm_s - window, comm_s / (layers + 2)) + profile.comm_overlap_tax * hidden


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


def _elementwise(model: ModelSpec, e: float) -> float:
    """:func:`elementwise_bytes`, cached per model and value size."""
    return per_model((id(model), e), model, lambda: elementwise_bytes(model, e))


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
    mem = T * L * (_elementwise(model, se) * fwd + lora_bytes)
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
    if st.method == "qlora":  # every copy dequantised per use (forward, input gradient, recomputation)
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
    if sp.first_touch:  # CPU: tensors above glibc's mmap threshold are new pages each time (memfit.estimate.faults)
        faults = sp.first_touch * fresh_bytes(b, s, model.heads, model.vocab, model.intermediate, L, e,
                                              st.attention == "eager", gc, getattr(st, "loss", "") == "chunked",
                                              mmap_threshold())
    # + each Linear4bit call's own cost (forward + input gradient; the forward again under checkpointing):
    # host work (bitsandbytes' Python and quant-state handling), so on a GPU it joins the dispatch
    calls_s = sp.dequant_call * L * calls * (1.5 if gc else 1.0)
    dequant_s = dequant / sp.dequant + (0.0 if sp.overlap_dispatch else calls_s)
    compute = dense_s + adapter_s + attn_s + mem / sp.bandwidth + dequant_s + faults + drop_s
    dispatch = dispatch_seconds(model, sp, len(adapted), st.attention == "eager", gc)
    dispatch += calls_s if sp.overlap_dispatch else 0.0
    return {"seconds": max(compute, dispatch) if sp.overlap_dispatch else compute + dispatch,
            "matmul_seconds": dense_s + adapter_s, "attention_seconds": attn_s,
            "memory_bound_seconds": mem / sp.bandwidth + faults + drop_s, "dequant_seconds": dequant_s,
            "dispatch_seconds": dispatch, "dense_flops": dense, "attention_flops": attn, "adapter_flops": adapter}


def trainable_tensors(model: ModelSpec, method: str, adapted: int) -> float:
    """Parameter tensors the optimizer visits: every weight, bias and norm (full), two per adapted linear
    (LoRA), one router per layer (MEFT)."""
    if method == "full":
        per_layer = len(model.linears) + len(model.biases) + model.norms_per_layer
        return float(model.layers * per_layer + 2 + (0 if model.tie_embeddings else 1))
    if method == "meft":
        return float(model.layers)
    return float(model.layers * adapted * 2)


def step_time(model: ModelSpec, hw: HardwareSpec, st: Any, p: Profile, *, engine: str, p_t: float,
              adapted: frozenset, gather_bytes: float, g_comm: float, w_comm: float, shard_o: bool,
              meft_rows: float = 0.0, meft_traffic: Any = None, fp32_stream: bool = False,
              fsdp: bool = False) -> dict[str, Any]:
    """The ``time`` object of the estimate (seconds per optimizer step, by part, with its basis) and the
    traffic and floor it implies: ``{"time": ..., "traffic": ..., "floor_seconds": ...}``."""
    prec, method, ga = st.precision, st.method, st.grad_accum
    n, cpu = hw.world_size, bool(hw.gpu.is_cpu)
    sp = speeds_for(hw, prec, st.attention, p)
    e = 4.0 if prec == "fp32" else 2.0
    router = p_t if method == "meft" else 0.0
    tensors_t = trainable_tensors(model, method, len(adapted))
    if sp.gpu is not None:  # a catalog GPU: the parts model (memfit.steptime)
        mb = gpu_micro_batch(model, sp.gpu, st, e, method == "full", adapted, meft_rows, router, fp32_stream, p,
                             "fsdp" if fsdp else engine, tensors_t)
    else:  # adapted: empty unless LoRA-style (the registry)
        mb = micro_batch(model, sp, st, e, method == "full", adapted, meft_rows, router, fp32_stream)
    off_opt, off_par = st.offload != "none", st.offload == "optimizer+params"
    local = p_t / (n if shard_o else 1)
    # FSDP2's optimizer steps a shard of every tensor (DTensors); DeepSpeed a flat partition
    tensors = tensors_t / (n if shard_o and not fsdp else 1)
    optim_s = optimizer_seconds(sp, engine, p_t, n, tensors, local, ga, off_opt)
    if sp.first_touch and method == "full" and not off_opt:  # CPU: fresh gradients and AdamW temporaries
        share = n if shard_o else 1  # full fine-tuning's large tensors: the embedding, the head, the linears
        big = [model.vocab * model.hidden / share] * (1 if model.tie_embeddings else 2) + \
            [lin.parameters / share for lin in model.linears] * model.layers
        optim_s += sp.first_touch * step_fresh_bytes(big, mmap_threshold(), 2.0 if prec == "bf16" else 4.0)
    cpu_opt_s = 0.0
    if off_opt:
        cpu_opt_s = (p_t / n) * sp.cpu_adam_per_param
    parts = comm_parts(engine, 0.0, gather_bytes, p_t, g_comm, w_comm, ga, st.gradient_checkpointing, fsdp) if n > 1 else {}
    cbytes = sum(parts.values())
    comm_s = 0.0
    if cbytes:
        calls = collective_calls(engine, model.layers, cbytes, ga, st.gradient_checkpointing,
                                 tensors_t, p_t, p.zero_reduce_bucket_per_h2 * model.hidden ** 2, fsdp)
        comm_s = sum(b * (n - 1) / n / sp.bus(op) for op, b in parts.items()) + calls * sp.collective_latency
    exposed = exposed_comm(comm_s, ga * mb.get("device_seconds", 0.0), engine, p, cpu, model.layers)
    pcie_b = 0.0
    if off_opt:
        pcie_b += ga * p_t / n * g_comm + p_t / n * w_comm
    if off_par:
        pcie_b += ga * (3.0 if st.gradient_checkpointing and not fsdp else 2.0) * gather_bytes / n  # per gather
    offload_s = (pcie_b / sp.h2d if pcie_b and not cpu else 0.0) * (1.0 - p.overlap_offload)
    traffic = {"h2d": 0.0, "d2h": 0.0, "comm_bytes_per_gpu": cbytes, "offload_pcie_bytes": pcie_b}
    meft_s = 0.0
    if meft_traffic is not None:
        traffic["h2d"], traffic["d2h"] = meft_traffic["h2d"], meft_traffic["d2h"]
        moved = 0.0 if cpu else meft_traffic["h2d"] / sp.h2d + meft_traffic["d2h"] / sp.d2h
        experts = meft_traffic["experts"]
        search = 2.0 * model.hidden * (experts + st.meft_n_probe * st.meft_neurons / experts)
        cpu_search = ga * float(st.micro_batch_size) * st.seq_len * model.layers * search / p.meft_cpu_flops
        cpu_update = ga * model.layers * 2.0 * meft_rows * model.hidden * sp.cpu_adam_per_param
        meft_s = moved * (1.0 - p.meft_overlap) + cpu_search + cpu_update
    engine_s = step_host_seconds(engine if not fsdp else "fsdp", tensors_t, p) if sp.gpu else 0.0
    engine_s += 0.0 if sp.overlap_dispatch or off_opt else engine_host_seconds(  # CPU, no offload: measured
        engine, fsdp, tensors_t, trainable_tensors(model, "full", 0), p_t, g_comm, gather_bytes, n, ga,
        sp.op_seconds, sp.bandwidth, p)
    trainer_ops = trainer_loop_ops(p, ga, len(adapted) * model.layers)
    trainer_s = trainer_ops * sp.op_seconds + (p.trainer_step_collectives * sp.collective_latency if n > 1 else 0.0)
    step = ga * mb["seconds"] + optim_s + exposed + offload_s + cpu_opt_s + meft_s + trainer_s + engine_s
    flops = ga * (mb["dense_flops"] + mb["attention_flops"] + mb["adapter_flops"])
    tokens = n * st.micro_batch_size * ga * st.seq_len
    time = {"step_seconds": step, "tokens_per_second": tokens / step if step > 0 else 0.0, "basis": sp.basis,
            "compute_seconds": ga * mb["seconds"], "matmul_seconds": ga * mb["matmul_seconds"],
            "attention_seconds": ga * mb["attention_seconds"],
            "memory_bound_seconds": ga * mb["memory_bound_seconds"], "dequant_seconds": ga * mb["dequant_seconds"],
            "dispatch_seconds": ga * mb["dispatch_seconds"], "optimizer_seconds": optim_s,
            "trainer_seconds": trainer_s, "trainer_ops": trainer_ops, "comm_seconds": comm_s, "comm_exposed_seconds": exposed,
            "offload_seconds": offload_s, "cpu_optimizer_seconds": cpu_opt_s, "meft_seconds": meft_s,
            "engine_seconds": engine_s,
            "flops_per_gpu": flops, "dense_flops": ga * mb["dense_flops"],
            "attention_flops": ga * mb["attention_flops"], "adapter_flops": ga * mb["adapter_flops"],
            "achieved_flops_per_second": flops / (ga * mb["seconds"]) if mb["seconds"] > 0 else 0.0}
    return {"time": time, "traffic": traffic, "floor_seconds": flops / sp.peak}
