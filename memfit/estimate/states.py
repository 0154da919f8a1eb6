"""Model states (weights, gradients, optimizer, what is offloaded) and the engines' buffers, per GPU."""

from __future__ import annotations

from typing import NamedTuple

from memfit.estimate import fsdp as F
from memfit.estimate import fsdp1 as F1
from memfit.estimate import pinned as P
from memfit.estimate.setup import Setup
from memfit.methods.base import Parameters


class States(NamedTuple):
    weights: float          # the weights line (stored shard + what the engine keeps unsharded)
    grads: float
    optim: float
    cpu_optim: float        # per process, in CPU RAM when the optimizer is offloaded
    cpu_grads: float
    cpu_params: float
    autocast_copy: float    # autocast's 16-bit weight copies (DDP): gone once backward has used them
    weights_all: float      # one full copy of the model's weights as stored
    compute_all: float      # one full copy in the dtype the matmuls use


class Buffers(NamedTuple):
    gathered: float         # gathered (unsharded) parameters
    comm: float             # communication buckets
    step_temp: float        # live only in the optimizer step
    layer_bufs: float       # part of gathered/comm that exists only while decoder layers run (FSDP)
    tail_bufs: float        # part of gathered live from the forward's end to the head's backward (FSDP)
    grad_comm_b: float      # bytes of a gradient value as reduced
    root_bufs: float = 0.0  # part of gathered live from the forward's start to the backward's end (FSDP1 root)
    root_grad: float = 0.0  # part of comm live through the layers' backward (FSDP1: the head's pending gradient)
    end_extra: float = 0.0  # held only at the backward's end (FSDP1 full: embedding grad + root's unsharded grad)
    layer_comm: float = 0.0  # part of layer_bufs held only in a unit's post-backward hook, not beside the layer's
    # backward working set (FSDP1: the unit's unsharded gradient + reduce-scatter output)
    post_bufs: float = 0.0  # FSDP1: what a unit's post-backward hook holds of the layer buffers (the prefetched
    # decoder layer, if any, + layer_comm)
    start_bufs: float = 0.0  # FSDP1: the last decoder layer the root's pre-backward hook prefetches (phase A)


def model_states(run: Setup, params: Parameters) -> States:
    n, trainable, quant_state = run.world, params.trainable, params.quant_state
    weights_all = params.frozen_bytes + trainable * run.weight_b
    compute_all = params.frozen_bytes + trainable * (run.copy_b or run.weight_b)
    sharded_all = run.engine.stores_sharded
    weights = (weights_all - quant_state) / n + quant_state if sharded_all else weights_all
    if run.fsdp_version == 1 and run.engine.shards_parameters and n > 1:  # FlatParameter padding (estimate.fsdp1)
        weights += F1.padding_bytes(run.model, n, int(run.weight_b if run.method.trains_base else run.value_b))
    autocast_copy = 0.0
    if run.engine.autocast:  # autocast's 16-bit weight copies: cached through forward and the loss, saved for
        autocast_copy = trainable * run.copy_b  # backward; gone once backward has used them
        weights += autocast_copy
    elif run.engine.keeps_unsharded_params:
        weights += compute_all  # SHARD_GRAD_OP keeps the unsharded params from forward to backward
    grads = trainable * run.grad_b / (n if run.shard_grads else 1)
    optim = trainable * run.optim_b / (n if run.shard_optim else 1)
    cpu_optim = cpu_grads = cpu_params = 0.0
    if run.offload_optimizer:
        cpu_optim, optim = optim, 0.0
        cpu_grads = trainable * 4.0 / n  # fp32 gradient partition where the CPU optimizer reads it
        grads = 0.0
    if run.offload_params:  # the quantisation state stays on the GPU (a buffer, not a flat parameter)
        cpu_params = (weights_all - quant_state) / n
        weights = quant_state
        if run.engine.pinned_offload and not run.gpu.is_cpu:  # pinned blocks, as the allocator rounds them
            root_b = F1.root_parameters(run.model) * (run.weight_b if run.method.trains_base else run.value_b)
            units = P.adapter_units(run.model, params.adapted, run.strategy.lora_r) \
                if run.method.fsdp_adapter_units and run.fsdp_version == 1 else ()
            cpu_params, cpu_grads = P.fsdp_offload(run, max(weights_all - quant_state - root_b, 0.0), root_b,
                                                   trainable * 4.0, units,
                                                   trainable * run.weight_b if units else 0.0)
    weights += params.working_weight  # QLoRA: a dequantised linear, whatever the offload
    return States(weights, grads, optim, cpu_optim, cpu_grads, cpu_params, autocast_copy, weights_all, compute_all)


def engine_buffers(run: Setup, params: Parameters, weights_all: float) -> Buffers:
    model, p, n, trainable = run.model, run.profile, run.world, params.trainable
    h2 = float(model.hidden) ** 2
    half = run.value_b
    gathered = comm = step_temp = layer_bufs = tail_bufs = 0.0
    g_comm = run.grad_b if run.engine.autocast else min(run.grad_b, half)  # FSDP reduces in the compute dtype
    sharded = run.engine.shards_parameters
    if sharded and run.fsdp_version == 1:
        return _fsdp1_buffers(run, params, g_comm)
    if sharded and run.fsdp:  # FSDP gathers whole wrapped decoder layers in the compute dtype
        layer_b, tail_b, layer_t = F.fsdp_units(model, run.method.trains_base,
                                                params.frozen_bytes - params.quant_state, trainable, half, half)
        comm = layer_t * g_comm * (1.0 + 1.0 / n)  # one layer's unsharded grads + reduce-scatter output
        gathered = p.gathered_layers * layer_b + tail_b
        if run.offload_params:  # CPUOffloadPolicy: each gathered layer's shard is first copied to the GPU
            gathered += p.gathered_layers * layer_b / n  # (_fully_shard/_fsdp_param.py:897-899)
        # the layers are resharded after their forward and backward (current + prefetched gathered while
        # layers run); the tail unit (final norm, head) stays gathered from the forward's end until its
        # backward (accelerate fsdp_utils.py:871-880, reshard_after_forward=False); in the step nothing is
        layer_bufs = gathered - tail_b + comm
        tail_bufs = tail_b
    elif sharded:  # DeepSpeed gathers module by module (current + prefetch bucket) and does not
        # release what is reused within stage3_max_reuse_distance: at the forward/backward turn that much stays
        largest = run.numbers.largest_linear
        live = min(max(largest + p.zero3_prefetch_per_h2 * h2, model.embedding_parameters,
                       p.zero3_max_reuse_distance),
                   max(p.zero3_max_live_parameters, largest))
        comm = p.zero_reduce_bucket_per_h2 * h2 * run.grad_b  # one reduce bucket, allocated whole (stage3.py:782)
        # the limits count elements of the stored tensors (QLoRA: NF4 packs 2 values per uint8, 4 per bf16)
        per_elem = run.method.gathered_per_element(run.strategy, p)
        total = run.total_params
        gathered = min(live * per_elem, total) * (weights_all - params.quant_state) / total
    elif run.engine.keeps_unsharded_params:
        comm = min(run.numbers.layer_params, trainable) * g_comm
        layer_bufs = comm  # a layer's unsharded gradients: only in backward
    elif run.engine.gathers_updated_params:  # the all-gather bucket is live only in the step (phase C)
        # the reduce bucket, allocated whole, doubled with overlap_comm (stage_1_and_2.py:3266-3277)
        # (memfit's DeepSpeed config turns overlap_comm on on CUDA only: memfit/distributed/config.py)
        overlap = 0.0 if run.gpu.is_cpu else p.zero_overlap_comm
        comm = (1.0 + overlap) * p.zero_reduce_bucket_per_h2 * h2 * run.grad_b
        step_temp = min(p.zero_allgather_bucket_elements, trainable) * run.weight_b
    elif n > 1:
        comm = trainable * run.grad_b * p.ddp_bucket_copy
    return Buffers(gathered, comm, step_temp, layer_bufs, tail_bufs, g_comm)


def _fsdp1_buffers(run: Setup, params: Parameters, g_comm: float) -> Buffers:
    """FSDP1 full_shard (each term's source: memfit.estimate.fsdp1): the decoder layers gathered while a layer
    runs backward (current + BACKWARD_PRE's prefetched; one where adapter units are nested) + the prefetched
    unit's low-precision (or offload-copied) shard, the last layer prefetched from the backward's first node,
    the root unit gathered from the forward's start to the backward's end, one layer's unsharded gradients +
    reduce-scatter output in its post-backward hook; full fine-tuning also holds the head's gradient through
    the layers' backward and, at the backward's end, the embedding's and the root's whole unsharded gradient."""
    model, p, n, trainable = run.model, run.profile, run.world, params.trainable
    half = run.value_b
    layer_b, _, layer_t = F.fsdp_units(model, run.method.trains_base, params.frozen_bytes - params.quant_state,
                                       trainable, half, half)
    root_b, head_g = F1.root_unit(model, half)
    layers = F1.backward_layers(run.method.fsdp_adapter_units, p.gathered_layers)
    if layers < p.gathered_layers:  # PEFT's adapter units: a decoder-layer unit holds the frozen weights only;
        layer_b -= layer_t * half  # its adapters are units of their own, gathered one at a time (a few kB)
    comm = layer_t * g_comm * (1.0 + 1.0 / n)  # one unit's unsharded grads + the reduce-scatter output
    # the prefetched unit's shard on the device while it gathers: _mp_shard (param dtype) where the flat
    # parameter is another dtype (fp32 trainable under mixed precision), or the offload H2D copy of the
    # shard (its own dtype; under mixed precision the fp32 copy is cast into _mp_shard)
    flat_b = run.weight_b if run.method.trains_base else half
    shard = 0.0
    if flat_b != half or run.offload_params:
        shard = layer_b / n * (flat_b / half if run.offload_params else 1.0)
    gathered = layers * layer_b + shard + root_b
    layer_comm = comm  # the post-backward hook's: after the unit's own reshard, beside the prefetched layer only
    root_grad = end_extra = 0.0
    if run.method.trains_base:
        root_grad = head_g
        comm += root_grad
        # at the end: the embedding's gradient + the root's unsharded gradient (the split's backward) + its
        # reduce-scatter output, with the head's still held
        emb = float(model.embedding_parameters) * half
        end_extra = emb + F1.root_parameters(model) * half * (1.0 + 1.0 / n)
    return Buffers(gathered, comm, 0.0, gathered - root_b + comm - root_grad, 0.0, g_comm,
                   root_bufs=root_b, root_grad=root_grad, end_extra=end_extra, layer_comm=layer_comm,
                   post_bufs=(layers - 1.0) * layer_b + layer_comm, start_bufs=layer_b)
