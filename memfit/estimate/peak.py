"""What is live at the same time: the step's peak over its phases, and the allocator's overhead.

Each line of the estimate is that component's own peak. Gradients are freed every step (set_to_none;
DeepSpeed drops its averaged partitions after the step, as measured with gloo on CPU), so with
grad_accum = 1 they build up only while backward frees activations; with accumulation they are live
throughout. Phases: A = start of backward (all saved activations + logits); F = the loss at the end of
forward; with checkpointing B1 = last layer recomputing (inputs + its working set + logits' grads); B2 =
backward at the first layer (its working set + nearly all gradients; FSDP1 with transformers < 4.52's reentrant
checkpoint: + every layer's input and gradient); FSDP1 only: P = the last layer's
post-backward hook (its unsharded gradient + reduce-scatter output beside the prefetched layer, after the
working set is freed) and E = the backward's end (the root's gradient); C = the optimizer step (grads +
step temporaries).

FSDP with accumulation under ``no_sync`` (``fsdp_sync_each_batch=false``) keeps *unsharded* gradients between
micro-batches: accelerate's ``no_sync`` (what the HF Trainer enters for every micro-batch but the last unless
accelerate's ``sync_each_batch`` is set, as memfit's trainer sets it by default) is
``FullyShardedDataParallel.no_sync`` for FSDP1 and ``set_requires_gradient_sync(False)`` for FSDP2
(accelerate/accelerator.py ``no_sync``); Lightning Fabric's ``no_backward_sync`` is FSDP1's ``no_sync`` too. FSDP1's
post-backward hook then returns before the reduce-scatter (torch/distributed/fsdp/_runtime_utils.py
``_post_backward_hook``: ``if not state._sync_gradients: ... return``;
``no_sync``'s note: "FSDP will accumulate the full model gradients (instead of gradient shards) until the
eventual sync"), and FSDP2's keeps the unsharded gradient (_fully_shard/_fsdp_param_group.py ``post_backward``:
``if not self.reduce_grads: ... to_accumulated_grad_if_needed(); return``). So every unit's whole gradient, at
the dtype it is reduced in, is live from the first micro-batch's backward until the last one's reduce-scatter
(``unsharded_grads``); the optimizer step sees the sharded gradients only.
"""

from __future__ import annotations

from typing import NamedTuple

from memfit.estimate import cuda as CU
from memfit.estimate import fsdp1 as F1
from memfit.estimate.saved import Saved
from memfit.estimate.setup import Setup
from memfit.estimate.states import Buffers, States
from memfit.methods.base import Parameters


class Peak(NamedTuple):
    phase: float            # bytes of the peak phase beyond the static lines
    held: float             # the activation working memory that phase holds beyond the saved tensors
    step_phase: float       # bytes of phase C (the optimizer step)
    mask: float             # the causal mask checkpointing keeps as a layer input (eager)
    accum_grads: float = 0.0  # gradients kept between micro-batches (FSDP's no_sync: unsharded), else 0


def unsharded_grads(run: Setup, params: Parameters, bufs: Buffers) -> float:
    """Bytes of the gradients FSDP keeps unsharded between micro-batches under ``no_sync`` (module docstring):
    every trainable parameter at the dtype it is reduced in; 0 without accumulation or without FSDP."""
    if not run.fsdp or run.strategy.grad_accum <= 1 or run.strategy.fsdp_sync_each_batch:
        return 0.0
    return params.trainable * bufs.grad_comm_b


def step_temporaries(run: Setup, params: Parameters, engine_step_temp: float) -> float:
    """Live only inside the optimizer step: optimizer temporaries, DeepSpeed's fp32 copy of 16-bit grads."""
    p = run.profile
    local_opt = 0.0 if run.offload_optimizer else params.trainable / (run.world if run.shard_optim else 1)
    step_temp = engine_step_temp
    if run.gpu.is_cpu:
        step_temp += local_opt * p.optimizer_step_temp_bytes
    elif run.strategy.optimizer == "adamw" and not run.engine.fused_adam:  # DeepSpeed: its own fused Adam
        step_temp += local_opt * p.adamw_foreach_temp_copies * run.optim_b / 2.0  # one state-sized sqrt(v)
    if run.engine.fp32_grad_copy and run.precision != "fp32" and not run.offload_optimizer:
        step_temp += grad_copy_elements(run, local_opt) * p.zero_fp32_grad_bytes
    return step_temp


def grad_copy_elements(run: Setup, local: float) -> float:
    """Gradient elements the step holds in fp32 at once: the whole local partition, or under ZeRO-3 the largest
    sub-group (at least ``zero3_sub_group_size`` elements, closed by the parameter that reaches it: at most
    that plus the largest parameter's partition, the embedding's)."""
    if not run.engine.grad_copy_per_sub_group:
        return local
    largest = max(run.model.embedding_parameters, run.numbers.largest_linear) / run.world
    return min(local, run.profile.zero3_sub_group_size + largest)


def step_peak(run: Setup, states: States, bufs: Buffers, saved: Saved, step_temp: float, attention: str,
              params: Parameters) -> Peak:
    model, p, nums, st = run.model, run.profile, run.numbers, run.strategy
    s, b, e, gc = st.seq_len, st.micro_batch_size, run.value_b, run.gc
    grads, autocast_copy, logits, tail_bufs = states.grads, states.autocast_copy, saved.logits, bufs.tail_bufs
    act_in, act_layers, act_bwd = saved.act_in, saved.act_layers, saved.act_bwd
    adapter_acts = saved.adapter.intermediates + saved.adapter.buffers_saved
    # with accumulation, earlier micro-batches' gradients stay live; DeepSpeed ZeRO-3 allocates its flat
    # gradient-partition buffer once (stage3.py: grad_partitions_flat_buffer), live in every phase
    g_keep = grads if st.grad_accum > 1 or run.engine.flat_grad_buffer else 0.0
    g_free = grads - g_keep
    accum = unsharded_grads(run, params, bufs)  # FSDP's no_sync: whole gradients until the last micro-batch
    g_keep = max(g_keep, accum)
    # act_bwd: one layer's backward working memory (eager's score gradients; + the causal mask that
    # checkpointing keeps as a layer input, live from the forward on)
    mask = float(b) * s * s * (4.0 if (e == 4.0 or saved.autocast) else e) if gc and attention == "eager" else 0.0
    mask = min(mask, act_bwd)
    held_saved = act_in + saved.act_tail + mask + (0.0 if gc else act_layers + adapter_acts)
    # candidate peaks as (bytes, the activation working memory beyond the saved tensors they hold)
    # FSDP1's root unit (embeddings, final norm, head) stays gathered from the forward's start to the
    # backward's end (memfit.estimate.fsdp1); with full fine-tuning the head's gradient waits in autograd
    # through the layers' backward (root_grad) — neither is live in the optimizer step
    root, root_g = bufs.root_bufs, bufs.root_grad
    tail_bufs = tail_bufs + root
    # A: start of backward (FSDP1: + the last decoder layer, prefetched by the root's pre-backward hook, which
    # the loss's backward node triggers: memfit.estimate.fsdp1)
    phases = [(g_keep + autocast_copy + held_saved + logits + tail_bufs + bufs.start_bufs, mask)]
    # F: the loss, end of forward: the 16-bit logits (the model's output), their fp32 upcast and the
    # log-softmax (8 B per logit in fp32, where the upcast is the logits themselves)
    fwd_logits = (logits - saved.head_grad) * ((e if e != 4.0 else 0.0) + 8.0) / 12.0 + saved.head_grad
    if saved.fused:  # the fused chunked loss makes its chunks' gradients in the forward: all of its line is live
        fwd_logits = logits
    phases.append((g_keep + autocast_copy + held_saved + saved.act_fwd + min(fwd_logits, logits) + tail_bufs,
                   mask + saved.act_fwd))
    # gradients live while the last layer runs backward: the head's and that layer's (full fine-tuning)
    # or one layer's adapters; while the first layer runs backward: all but its own and the embedding's
    total, full = run.total_params, run.method.trains_base
    # FSDP1 full fine-tuning: the head's gradient waits unsharded in autograd (root_g) and the root is reduced
    # only at the backward's end (phase E): no head shard beside the layers' backward
    head = 0.0 if root_g else model.head_parameters
    last = (nums.layer_params + head) / total if full else 1.0 / model.layers
    g_last = g_free * min(1.0, last)
    first = (nums.layer_params + model.embedding_parameters + model.head_parameters - head) / total if full \
        else 1.0 / model.layers
    g_first = g_free * max(0.0, 1.0 - first)
    # FSDP1: a unit's unsharded gradient + reduce-scatter output live only in its post-backward hook, after its
    # backward's working set is freed and its own parameters resharded (phase P below, memfit.estimate.fsdp1)
    layer_bufs = bufs.layer_bufs - bufs.layer_comm + root + root_g
    if gc:
        working = act_layers + adapter_acts + act_bwd + layer_bufs
        # B1: the last layer recomputes (the tail and logits are freed by then: their backward has run)
        # B2: the first layer; FSDP1 under transformers < 4.52's reentrant checkpoint keeps the other layers'
        # inputs and their gradients to the backward's end (memfit.estimate.fsdp1)
        kept = F1.reentrant_retained(gc, st.hf_legacy_checkpoint, act_in, model.layers) \
            if run.fsdp_version == 1 else 0.0
        phases += [(g_keep + working + act_in + p.logits_live_during_recompute * (logits - saved.head_grad) + g_last,
                    act_bwd),
                   (g_keep + working + act_in / model.layers + kept + g_first, act_bwd)]
    else:  # backward in the last layer (all saved + its backward working memory), then at the first layer
        phases += [(g_keep + autocast_copy + act_layers + adapter_acts + act_bwd + layer_bufs + g_last, act_bwd),
                   (g_keep + (act_layers + adapter_acts) / model.layers + act_bwd + layer_bufs + g_first, act_bwd)]
    if bufs.post_bufs:  # P (FSDP1): the last layer's post-backward hook — the layers' inputs below (their saved
        # tensors without checkpointing), the prefetched layer, the unit's unsharded gradient + reduce-scatter
        # output, the root, the gradient of the layer's input
        below = act_in if gc else autocast_copy + (act_layers + adapter_acts) * (model.layers - 1) / model.layers
        hidden = float(b) * s * model.hidden * (4.0 if (e == 4.0 or saved.autocast or params.fp32_stream) else e)
        post = bufs.post_bufs - (bufs.layer_comm if accum else 0.0)  # no_sync: the hook returns before reducing
        phases.append((g_keep + below + post + root + root_g + hidden + g_last, 0.0))
    if bufs.end_extra:  # E (FSDP1, full fine-tuning): the backward's end, the root's gradient made and reduced;
        # under no_sync beside every unit's unsharded gradient, and not reduce-scattered (no shard-sized output)
        rs_out = F1.root_parameters(model) * e / run.world if accum else 0.0
        phases.append((max(grads, accum) + root + root_g + bufs.end_extra - rs_out, 0.0))
    phases.append((grads + step_temp, 0.0))  # C: the optimizer step
    phase, held = max(phases)
    return Peak(phase, held, phases[-1][0], mask, accum)


def fragmentation(run: Setup, params: Parameters, saved: Saved, peak: Peak, formula: float) -> CU.Gap:
    """The allocator's gap between reserved and allocated memory at the peak (on the CPU: all ``split``)."""
    model, p, st = run.model, run.profile, run.strategy
    if run.gpu.is_cpu:  # glibc's brk heap: the holes freed tensors leave stay resident (constants.py); they
        # follow the layers' activations each micro-batch allocates (all layers' saved set without checkpointing;
        # with it the same tensors are made in the forward and again, layer by layer, in the recomputation)
        layer = ((saved.act_layers + saved.adapter.intermediates)
                 / (p.checkpoint_extra_layers if run.gc else model.layers))
        frac = p.fragmentation_cpu if run.method.trains_base else p.fragmentation_cpu_adapters
        return CU.Gap(p.fragmentation_cpu_bytes + frac * layer * model.layers, 0.0, 0.0)
    # the caching allocator: reserved = allocated + what it keeps cached (one layer's working set)
    working_set = (saved.act_layers + saved.adapter.intermediates) / (
        p.checkpoint_extra_layers if run.gc else model.layers)
    if model.experts:  # experts allocate their share one after another: blocks of 1/E of the routed
        routed = model.experts_per_token * model.moe_intermediate  # set, reused expert to expert
        value_b = 4.0 if params.fp32_stream else run.value_b
        working_set -= (1.0 - 1.0 / model.experts) * float(st.micro_batch_size) * st.seq_len * value_b * 3 * routed
    # + one layer's backward transients (gradients of its MLP/attention), freed and cached the same way;
    # when the optimizer step is the peak, the loss's blocks (the logits line) stay reserved beside it
    step_is_peak = peak.step_phase >= peak.phase
    return CU.gap_parts(formula, working_set + saved.act_bwd - peak.mask, saved.logits if step_is_peak else 0.0,
                        run.offload_optimizer or run.offload_params, p, step_is_peak,
                        expandable=st.allocator == "expandable_segments")
