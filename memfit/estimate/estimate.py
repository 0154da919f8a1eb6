"""estimate(model, hardware, strategy) -> Estimate: memory per GPU, CPU RAM per node, step time.

``Estimate.to_dict()`` is the ``memfit estimate --json`` contract (see docs/estimator.md). GPU lines:
formula lines (weights, gradients, optimizer, activations, logits, lora_intermediates, meft_buffers),
engine lines derived from the engine's configuration (gathered_params, comm_buffers), the
``peak_concurrency`` adjustment (what is not live at the same time) and one ``overhead`` line (CUDA context + NCCL buffers + allocator fragmentation, itemised in
``memory.gpu_overhead_bytes``). The numeric lines of ``gpu_bytes`` other than ``total`` sum to ``total``.
"""

from __future__ import annotations

from typing import Optional

from memfit.estimate import activations as A
from memfit.estimate import cuda as CU
from memfit.estimate import fsdp as F
from memfit.estimate import memory as M
from memfit.estimate import meft as MF
from memfit.estimate.meft import meft_traffic_bytes
from memfit.estimate import timing as T
from memfit.estimate.constants import DEFAULT_PROFILE, Profile
from memfit.estimate.result import Estimate
from memfit.spec.hardware import HardwareSpec
from memfit.methods import METHODS
from memfit.spec.model import ModelSpec, lora_target_reason
from memfit.spec.strategy import DEFAULT_LORA_TARGETS, Strategy

STORAGE_BYTES = {"uint8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}  # bnb_4bit_quant_storage element
_ENGINE_KIND = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
                "fsdp-full_shard": "zero3", "fsdp-shard_grad_op": "sgo"}


def _targets(model: ModelSpec, strategy: Strategy):
    """LoRA targets; PEFT's Llama-style default on a model without those names means all linears."""
    targets = strategy.lora_targets
    if targets == DEFAULT_LORA_TARGETS and not M.numbers(model).lora_sums(targets)[0]:
        return ("all-linear",)
    return targets


def estimate(model: ModelSpec, hardware: HardwareSpec, strategy: Strategy, profile: Optional[Profile] = None,
             margin: float = 0.05, activation_formula: Optional[str] = None, distributed=None) -> Estimate:
    """Estimate one combination. ``activation_formula``: None/"derived" or "korthikanti" (GPT-style).
    ``distributed``: the run's ``distributed`` settings (reduce/allgather bucket sizes) for DeepSpeed."""
    p = profile or DEFAULT_PROFILE
    if distributed is not None and strategy.zero_stage:
        p = M.with_buckets(p, model, distributed)
    if activation_formula == "korthikanti" and not p.activation_korthikanti:
        p = p.with_values(activation_korthikanti=1.0)
    elif activation_formula not in (None, "derived", "korthikanti"):
        from memfit.errors import ConfigError
        raise ConfigError(f"activation_formula {activation_formula!r}: use 'derived' or 'korthikanti'")
    if not 0.0 <= margin < 1.0:
        from memfit.errors import ConfigError
        raise ConfigError(f"margin {margin}: must be a fraction in [0, 1), e.g. 0.05 keeps 5% of GPU memory free")
    st = strategy
    gpu = hardware.gpu
    n = hardware.world_size
    per_node = hardware.gpus_per_node
    s, b, ga = st.seq_len, st.micro_batch_size, st.grad_accum
    method_spec = METHODS[st.method]  # the registry's method: counted as its family plus its own hooks
    method, prec = method_spec.family, st.precision
    engine = _ENGINE_KIND[st.engine]
    family = "fsdp" if st.fsdp else ("deepspeed" if st.zero_stage else "ddp")
    w_b, g_b, o_b, copy_b = M.state_bytes(prec, st.optimizer, family, st.zero_stage)
    # PEFT keeps LoRA adapters in fp32 unless DeepSpeed casts the whole module to 16-bit
    adapter_fp32 = method in ("lora", "qlora") and family != "deepspeed" and prec != "fp32"
    if adapter_fp32:
        w_b, g_b, o_b = 4.0, 4.0, M.state_bytes("fp32", st.optimizer, "ddp")[2]
    e = half = 4.0 if prec == "fp32" else 2.0  # bytes of a value in the compute dtype
    nums = M.numbers(model)
    P = float(model.parameters)
    reasons: list[str] = []

    # ---- what is trained, what is frozen, and at what storage --------------------------------------
    targets = ()
    adapter_params = 0.0
    quant_state = 0.0  # NF4 absmax (+ nested quant): module attributes that FSDP/ZeRO neither shard nor offload
    fp32_stream = False  # QLoRA after prepare_model_for_kbit_training: fp32 embeddings, norms and head
    if method == "full":
        p_t, frozen_bytes = P, 0.0
    elif method in ("lora", "qlora"):
        targets = _targets(model, st)
        p_t = float(model.lora_parameters(targets, st.lora_r) + method_spec.extra_trainable_parameters(model, targets))
        adapter_params = p_t
        if p_t == 0:
            reasons.append(lora_target_reason(model, targets))
        if method == "qlora":
            absmax = p.nf4_absmax_bytes_double_quant if st.double_quant else p.nf4_absmax_bytes
            # prepare_model_for_kbit_training upcasts the rest to fp32, but not under ZeRO-3/FSDP (it breaks
            # their uniform-dtype flattening: fsdp-qlora.md), where it stays in the 16-bit storage dtype
            upcast = p.qlora_fp32_upcast and not (st.fsdp or st.zero_stage == 3)
            other_b = 4.0 if (upcast or prec == "fp32") else 2.0
            fp32_stream = bool(upcast) and prec != "fp32"
            frozen_bytes = nums.linear_params * (p.nf4_bytes_per_param + absmax) + nums.other_params * other_b
            quant_state = nums.linear_params * absmax
            if st.fsdp and st.quant_storage == "uint8":  # accelerate leaves non-float Params4bit out of FSDP2
                quant_state += nums.linear_params * p.nf4_bytes_per_param  # (fsdp_utils.py:800-811): replicated
        else:
            frozen_bytes = P * half
    else:  # meft: adapter on CPU, router (h × experts per layer) trained on the GPU
        experts = M.meft_experts(st.meft_neurons, st.meft_experts)
        p_t = float(model.layers * model.hidden * experts)
        frozen_bytes = P * half
    trainable_total = p_t + (2.0 * model.layers * st.meft_neurons * model.hidden if method == "meft" else 0.0)

    sharded_w = engine == "zero3"
    shard_g = engine in ("zero2", "zero3", "sgo")
    shard_o = engine != "ddp"
    off_opt = st.offload != "none"
    off_par = st.offload == "optimizer+params"
    fsdp = bool(st.fsdp)

    weights_all = frozen_bytes + p_t * w_b  # one full copy of the model's weights as stored
    compute_all = frozen_bytes + p_t * (copy_b or w_b)  # one full copy in the dtype the matmuls use
    sharded_all = sharded_w or family == "fsdp"
    weights = (weights_all - quant_state) / n + quant_state if sharded_all else weights_all
    autocast_copy = 0.0
    if family == "ddp":  # autocast's 16-bit weight copies: cached through forward and the loss, saved for
        autocast_copy = p_t * copy_b  # backward; gone once backward has used them
        weights += autocast_copy
    elif engine == "sgo":
        weights += compute_all  # SHARD_GRAD_OP keeps the unsharded params from forward to backward
    grads = p_t * g_b / (n if shard_g else 1)
    optim = p_t * o_b / (n if shard_o else 1)
    cpu_opt = cpu_grads = cpu_params = 0.0
    if off_opt:
        cpu_opt, optim = optim, 0.0
        cpu_grads = p_t * 4.0 / n  # fp32 gradient partition where the CPU optimizer reads it
        grads = 0.0
    if off_par:  # the quantisation state stays on the GPU (a buffer, not a flat parameter)
        cpu_params = (weights_all - quant_state) / n
        weights = quant_state
    if method == "qlora":  # one Linear4bit dequantised to 16-bit at a time, whatever the offload
        weights += nums.largest_linear * 2.0

    # ---- activations, logits, adapters -------------------------------------------------------------
    gc = st.gradient_checkpointing
    backend = CU.sdpa_backend(gpu, model, prec, st.attention)  # the kernel SDPA dispatches to on this GPU
    attention = CU.attention_for_memory(backend, st.attention)
    # fp32 adapters on a 16-bit base: PEFT casts lora_A's input to fp32; lora_A saves that copy in pure
    # bf16, or autocast's 16-bit copy of it under mixed precision (traced). In fp32, and where the engine
    # holds the adapters in 16-bit (DeepSpeed, FSDP), lora_A reads the base linear's input.
    cast_copy = (4.0 if prec == "bf16" else 2.0) if adapter_fp32 and family == "ddp" else 0.0
    # torch autocast on fp32 weights (full fine-tuning under plain DDP, as the HF Trainer runs it): fp32
    # residual stream, every linear casts its input to 16-bit itself. Adapter methods load the base in
    # 16-bit and DeepSpeed / FSDP's MixedPrecision hold 16-bit parameters: 16-bit activations.
    autocast = prec.endswith("-mixed") and family == "ddp" and method == "full"
    adapted = M.numbers(model).lora_sums(targets)[2] if adapter_params else frozenset()
    # dropout runs after PEFT's fp32 cast; on CPU its mask is a noise tensor of that dtype, CUDA's fused
    # kernel keeps 1 byte
    mask_b = (4.0 if cast_copy else e) if gpu.is_cpu else 1.0
    # backward through a cast adapter path: the gradient of lora_A's cast input, at its widest; what the
    # adapters after the attention save is freed before the attention's backward
    widest = max((lin.in_features for lin in model.linears if lin.name in adapted), default=0)
    copy_b = ((cast_copy or e) + mask_b) if st.lora_dropout > 0 else cast_copy
    rank_b = 4.0 if cast_copy == 4.0 else e
    after_attn = sum((copy_b * lin.in_features + rank_b * st.lora_r) * lin.count * lin.active for lin in model.linears
                     if lin.name in adapted and A.ROLES.get(lin.name) != "attn_in")
    act_in, act_layers, act_tail, act_bwd = A.activation_parts(
        model, s, b, e, attention, gc, p, method=method, adapted=adapted,
        shares=st.lora_dropout == 0 and not cast_copy, autocast=autocast, adapter_grad=cast_copy * widest,
        adapter_mlp_side=after_attn, fp32_stream=fp32_stream)
    # at the end of the forward the model still holds the final norm's output, and its KV cache (use_cache:
    # what the trainer leaves on unless checkpointing turns it off): under autocast RoPE promotes k to
    # fp32 while SDPA saves its own 16-bit copy, elsewhere the cache shares what attention saves
    r_b = 4.0 if (e == 4.0 or autocast or fp32_stream) else e
    if fp32_stream:  # the fp32 head under autocast: its 16-bit weight copy is saved for the input's gradient
        act_tail += (model.head_parameters or model.embedding_parameters) * half * p.activation_scale
    act_fwd = float(b) * s * (r_b * model.hidden
                              + (model.layers * model.kv_dim * 4.0 if autocast and not gc else 0.0))
    act_fwd *= 0.0 if p.activation_korthikanti else p.activation_scale
    # loss=chunked: the fused path (gradients made in the forward) except under DeepSpeed ZeRO-3, whose
    # partitioned head weight only the module call gathers (the recomputing path)
    fused = st.loss == "chunked" and not (engine == "zero3" and not fsdp)
    logits = M.logits_bytes(model, s, b, prec, p, st.loss, fused)
    head_grad = 0.0
    if st.loss == "chunked":  # + the hidden-state gradients the loss makes in the forward, held for backward
        logits += float(b) * s * model.hidden * r_b
        # full fine-tuning: + the head weight's gradient, accumulated over the chunks in the forward and held
        # until backward hands it to .grad (the fused path; under DeepSpeed ZeRO-3 the loss recomputes
        # instead and makes it in backward). In the weight's dtype: fp32 under DDP's autocast, FSDP's
        # unsharded compute dtype, ZeRO-1/2's 16-bit module weights
        if method == "full" and fused:
            hb = g_b if family == "ddp" else min(g_b, half)
            head_grad = float(model.head_parameters or model.embedding_parameters) * hb
            logits += head_grad
    lora_int = 0.0
    if adapter_params:
        lora_int = M.lora_intermediate_bytes(model, s, b, e, targets, st.lora_r, st.lora_dropout, gc, p,
                                             cast_copy=cast_copy, mask_bytes=mask_b)
        if st.lora_dropout > 0 and not gc:  # layer 0: dropout on an input that needs no gradient keeps
            # no mask (checkpointing makes the embeddings' output require grad: then it does)
            lora_int -= float(b) * s * mask_b * sum(lin.in_features for lin in model.linears
                                                    if lin.name in adapted and A.ROLES.get(lin.name) == "attn_in")
        lora_int += method_spec.extra_saved_bytes(
            model, st, targets, tokens=b * s, compute_bytes=e, adapter_bytes=rank_b, cast_bytes=cast_copy,
            layers=p.checkpoint_extra_layers if gc else model.layers)
    meft_buf = meft_acts = meft_host = rows = 0.0
    if method == "meft":
        meft_buf, meft_acts, meft_host, rows = MF.meft_memory(model, st, p, e, gpu.is_cpu)

    # ---- engine buffers -------------------------------------------------------------------------
    h2 = float(model.hidden) ** 2
    gathered = comm = step_temp = 0.0
    layer_bufs = 0.0  # part of gathered/comm that exists only while decoder layers run (FSDP)
    tail_bufs = 0.0  # part of gathered that exists only from the forward's end to the head's backward (FSDP)
    g_comm = g_b if family == "ddp" else min(g_b, half)  # FSDP reduces in the compute dtype
    if engine == "zero3":
        if fsdp:  # FSDP gathers whole wrapped decoder layers in the compute dtype
            layer_b, tail_b, layer_t = F.fsdp_units(model, method, frozen_bytes - quant_state, p_t, half, half)
            comm = layer_t * g_comm * (1.0 + 1.0 / n)  # one layer's unsharded grads + reduce-scatter output
            gathered = p.gathered_layers * layer_b + tail_b
            if off_par:  # CPUOffloadPolicy: each gathered layer's shard is first copied to the GPU
                gathered += p.gathered_layers * layer_b / n  # (_fully_shard/_fsdp_param.py:897-899)
            # the layers are resharded after their forward and backward (current + prefetched gathered while
            # layers run); the tail unit (final norm, head) stays gathered from the forward's end until its
            # backward (accelerate fsdp_utils.py:871-880, reshard_after_forward=False); in the step nothing is
            layer_bufs = gathered - tail_b + comm
            tail_bufs = tail_b
        else:  # DeepSpeed gathers module by module (current + prefetch bucket) and does not release what is
            # reused within stage3_max_reuse_distance: at the forward/backward turn that much stays gathered
            live = min(max(nums.largest_linear + p.zero3_prefetch_per_h2 * h2, model.embedding_parameters,
                           p.zero3_max_reuse_distance),
                       max(p.zero3_max_live_parameters, nums.largest_linear))
            comm = p.zero_reduce_bucket_per_h2 * h2 * g_b  # one reduce bucket, allocated whole (stage3.py:782)
            # the limits count elements of the stored tensors: NF4 packs 2 values per uint8, 4 per bf16
            per_elem = STORAGE_BYTES[st.quant_storage] / p.nf4_bytes_per_param if method == "qlora" else 1.0
            gathered = min(live * per_elem, P) * (weights_all - quant_state) / P
    elif engine == "sgo":
        comm = min(nums.layer_params, p_t) * g_comm
        layer_bufs = comm  # a layer's unsharded gradients: only in backward
    elif engine in ("zero1", "zero2"):  # the all-gather bucket is live only in the step (phase C below)
        # the reduce bucket, allocated whole, doubled with overlap_comm (stage_1_and_2.py:3266-3277)
        # (memfit's DeepSpeed config turns overlap_comm on on CUDA only: memfit/distributed/config.py)
        comm = (1.0 + (0.0 if gpu.is_cpu else p.zero_overlap_comm)) * p.zero_reduce_bucket_per_h2 * h2 * g_b
        step_temp = min(p.zero_allgather_bucket_elements, p_t) * w_b
    elif n > 1:
        comm = p_t * g_b * p.ddp_bucket_copy

    # ---- what is live at the same time: the step's peak -----------------------------------------
    # Each line above is that component's own peak. Gradients are freed every step (set_to_none; DeepSpeed
    # drops its averaged partitions after the step, as measured with gloo on CPU), so with grad_accum = 1
    # they build up only while backward frees activations; with accumulation they are live throughout.
    # Phases: A = start of backward (all saved activations + logits); with checkpointing B1 = last layer
    # recomputing (inputs + its working set + logits' grads); B2 = backward at the first layer (its
    # working set + nearly all gradients); C = the optimizer step (grads + step temporaries).
    static = weights - autocast_copy + optim + (meft_buf - meft_acts) + gathered + comm - layer_bufs - tail_bufs
    adapter_acts = lora_int + meft_acts
    # with accumulation, earlier micro-batches' gradients stay live; DeepSpeed ZeRO-3 allocates its flat
    # gradient-partition buffer once (stage3.py: grad_partitions_flat_buffer), live in every phase
    g_keep = grads if ga > 1 or (engine == "zero3" and not fsdp) else 0.0
    g_free = grads - g_keep
    # act_bwd: one layer's backward working memory (eager's score gradients; + the causal mask that
    # checkpointing keeps as a layer input, live from the forward on)
    mask = float(b) * s * s * (4.0 if (e == 4.0 or autocast) else e) if gc and attention == "eager" else 0.0
    mask = min(mask, act_bwd)
    saved = act_in + act_tail + mask + (0.0 if gc else act_layers + adapter_acts)
    # candidate peaks as (bytes, the activation working memory beyond the saved tensors they hold)
    phases = [(g_keep + autocast_copy + saved + logits + tail_bufs, mask)]  # A: start of backward
    # F: the loss, end of forward: the 16-bit logits (the model's output), their fp32 upcast and the
    # log-softmax (8 B per logit in fp32, where the upcast is the logits themselves)
    fwd_logits = (logits - head_grad) * ((e if e != 4.0 else 0.0) + 8.0) / 12.0 + head_grad
    if fused:  # the fused chunked loss makes its chunks' gradients in the forward: all of its line is live there
        fwd_logits = logits
    phases.append((g_keep + autocast_copy + saved + act_fwd + min(fwd_logits, logits) + tail_bufs, mask + act_fwd))
    # gradients live while the last layer runs backward: the head's and that layer's (full fine-tuning)
    # or one layer's adapters
    last = (nums.layer_params + model.head_parameters) / P if method == "full" else 1.0 / model.layers
    g_last = g_free * min(1.0, last)
    # ... and while the first layer runs backward: all but its own and the embedding's (traced)
    first = (nums.layer_params + model.embedding_parameters) / P if method == "full" else 1.0 / model.layers
    g_first = g_free * max(0.0, 1.0 - first)
    if gc:
        working = act_layers + adapter_acts + act_bwd + layer_bufs
        # B1: the last layer recomputes (the tail and logits are freed by then: their backward has run)
        phases += [(g_keep + working + act_in + p.logits_live_during_recompute * (logits - head_grad) + g_last, act_bwd),
                   (g_keep + working + act_in / model.layers + g_first, act_bwd)]  # B2: the first layer
    else:  # backward in the last layer (all saved + its backward working memory), then at the first layer
        phases += [(g_keep + autocast_copy + act_layers + adapter_acts + act_bwd + layer_bufs + g_last, act_bwd),
                   (g_keep + (act_layers + adapter_acts) / model.layers + act_bwd + layer_bufs + g_first, act_bwd)]
    local_opt = 0.0 if off_opt else p_t / (n if shard_o else 1)
    # live only inside the optimizer step: optimizer temporaries, DeepSpeed's fp32 copy of 16-bit grads
    if gpu.is_cpu:
        step_temp += local_opt * p.optimizer_step_temp_bytes
    elif st.optimizer == "adamw" and family != "deepspeed":  # DeepSpeed steps with its own fused Adam
        step_temp += local_opt * p.adamw_foreach_temp_copies * o_b / 2.0  # one state-sized sqrt(v) per param
    if family == "deepspeed" and prec != "fp32" and not off_opt:
        step_temp += local_opt * p.zero_fp32_grad_bytes
    phases.append((grads + step_temp, 0.0))  # C: the optimizer step
    phase, held = max(phases)
    # the activations line: the saved tensors + the working memory the peak phase holds beyond them
    acts = act_in + act_layers + act_tail + held
    lines_sum = static + layer_bufs + tail_bufs + autocast_copy + grads + acts + logits + adapter_acts + step_temp
    concurrency = static + phase - lines_sum
    formula = static + phase
    cuda_ctx = CU.context_bytes(gpu, p)
    nccl = CU.nccl_bytes(hardware, p)
    if gpu.is_cpu:
        frag = formula * p.fragmentation_cpu
    else:  # the caching allocator: reserved = allocated + what it keeps cached (one layer's working set)
        working_set = (act_layers + lora_int) / (p.checkpoint_extra_layers if gc else model.layers)
        if model.experts:  # experts allocate their share one after another: blocks of 1/E of the routed
            routed = model.experts_per_token * model.moe_intermediate  # set, reused expert to expert
            working_set -= (1.0 - 1.0 / model.experts) * float(b) * s * (4.0 if fp32_stream else e) * 3 * routed
        # + one layer's backward transients (gradients of its MLP/attention), freed and cached the same way;
        # when the optimizer step is the peak, the loss's blocks (the logits line) stay reserved beside it
        step_peak = phases[-1][0] >= phase
        frag = CU.reserved_gap(formula, working_set + act_bwd - mask, logits if step_peak else 0.0, off_opt or off_par, p)
    overhead = cuda_ctx + nccl + frag
    gpu_lines = {"weights": weights, "gradients": grads, "optimizer": optim, "activations": acts,
                 "logits": logits, "lora_intermediates": lora_int, "meft_buffers": meft_buf,
                 "gathered_params": gathered, "comm_buffers": comm, "step_temporaries": step_temp,
                 "peak_concurrency": concurrency, "overhead": overhead, "total": formula + overhead}

    gpu_loading = 0.0 if gpu.is_cpu else CU.qlora_loading_peak(model, method, engine == "zero3" or fsdp, quant_state,
                                                                nums, half, p)
    # ---- CPU RAM per node ------------------------------------------------------------------------
    procs = per_node
    meft_store = meft_host
    pinned = p.pinned_buffer_bytes if off_opt and not gpu.is_cpu else 0.0
    steady = procs * (cpu_opt + cpu_grads + cpu_params + pinned + meft_store)
    # memfit's trainer loads full fine-tuning under mixed precision in fp32 (autocast keeps fp32 masters)
    load_b = 4.0 if prec == "fp32" or (method == "full" and prec in ("fp16-mixed", "bf16-mixed")) else 2.0
    if gpu.is_cpu:
        loading = 0.0  # the model is loaded into the same RAM it trains in ("gpu" lines)
    elif engine == "zero3" and not fsdp or (method == "qlora" and not fsdp):
        loading = procs * p.checkpoint_shard_bytes  # zero.Init / device_map: one shard at a time
    elif st.fsdp == "full_shard":
        loading = P * load_b  # cpu_ram_efficient_loading: rank 0 materialises one 16-bit copy per node
        # (QLoRA too: rank 0 reads the 16-bit checkpoint before quantising — the "140 GB" of fsdp-qlora.md)
    else:
        loading = procs * P * load_b  # every process builds a full copy before moving it to its GPU
    if gpu.is_cpu:  # no CUDA libraries or context; torchrun ranks add a process group and engine imports
        baseline = procs * (p.process_baseline_bytes_cpu + (p.process_baseline_dist_cpu if n > 1 else 0.0))
    else:
        baseline = procs * p.process_baseline_bytes
    cpu_total = baseline + max(steady, loading)
    cpu_lines = {"process_baseline": baseline, "model_loading": loading, "offloaded_optimizer": procs * cpu_opt,
                 "offloaded_gradients": procs * cpu_grads, "offloaded_params": procs * cpu_params,
                 "pinned_buffers": procs * pinned, "meft_store": procs * meft_store, "total": cpu_total}

    # ---- time (memfit.estimate.timing: parts at measured or catalog speeds) ----------------------
    mt = None
    if method == "meft":
        mt = {**meft_traffic_bytes(model, st, p), "experts": M.meft_experts(st.meft_neurons, st.meft_experts)}
    timed = T.step_time(model, hardware, st, p, engine=engine, p_t=p_t, adapted=adapted,
                        gather_bytes=compute_all if family == "fsdp" else weights_all, g_comm=g_comm,
                        w_comm=min(w_b, half), shard_o=shard_o, meft_rows=rows, meft_traffic=mt)
    time, traffic, floor_s = timed["time"], timed["traffic"], timed["floor_seconds"]

    # ---- verdict --------------------------------------------------------------------------------
    usable = gpu.memory_bytes * (1.0 - margin)
    gpu_total = gpu_lines["total"]
    if gpu.is_cpu:  # one RAM holds every process's "device" lines and the process/offload lines
        need = per_node * gpu_total + cpu_total
        if need > usable:
            procs_txt = f"{per_node} x " if per_node > 1 else ""
            reasons.append(f"RAM: needs {need / 1e9:.2f} GB (model {procs_txt}{gpu_total / 1e9:.2f} + process/offload "
                           f"{cpu_total / 1e9:.2f}), usable {usable / 1e9:.2f} GB; over by {(need - usable) / 1e9:.2f} GB")
    else:
        if gpu_total > usable:
            reasons.append(f"GPU memory: needs {gpu_total / 1e9:.2f} GB per GPU, usable {usable / 1e9:.2f} GB "
                           f"({gpu.name} x (1 - margin {margin:g})); over by {(gpu_total - usable) / 1e9:.2f} GB")
        elif gpu_loading + cuda_ctx > usable:
            reasons.append(f"GPU memory while loading: quantising to NF4 holds {(gpu_loading + cuda_ctx) / 1e9:.2f} GB "
                           f"per GPU before training starts, "
                           f"usable {usable / 1e9:.2f} GB; over by {(gpu_loading + cuda_ctx - usable) / 1e9:.2f} GB")
        if cpu_total > hardware.cpu_ram_bytes:
            reasons.append(f"CPU RAM: needs {cpu_total / 1e9:.2f} GB per node, have {hardware.cpu_ram_bytes / 1e9:.2f} GB "
                           f"(set --cpu-ram if the node has more); over by {(cpu_total - hardware.cpu_ram_bytes) / 1e9:.2f} GB")
    floor_mem = (frozen_bytes if method != "full" else P * half) / (n if sharded_w else 1)
    return Estimate(model=model, hardware=hardware, strategy=st, gpu=gpu_lines,
                    gpu_overhead={"cuda_context": cuda_ctx, "nccl_buffers": nccl, "allocator_fragmentation": frag},
                    cpu=cpu_lines, cpu_phase="loading" if loading > steady else "training", time=time,
                    traffic=traffic, fits=not reasons, reasons=reasons, trainable_parameters=trainable_total,
                    floor_memory=floor_mem, floor_seconds=floor_s, margin=margin, usable_gpu_bytes=usable,
                    attention_backend=backend, gpu_loading=gpu_loading)
