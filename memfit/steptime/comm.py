"""The engines' collectives on every device: bytes per primitive, launches, and how much of them a step waits
for (memfit.steptime.step)."""

from __future__ import annotations

import math

from memfit.engines import engine_cost
from memfit.steptime.constants import TimeProfile

BUCKET_BYTES = 25e6  # DDP's bucket_cap_mb (25) and the order of DeepSpeed's reduce buckets: one call each


def comm_parts(engine_kind: str, p_all: float, weight_bytes_all: float, p_t: float, g_b: float, w_b: float,
               ga: int, checkpointing: bool, fsdp: bool = False, no_sync: bool = False) -> dict[str, float]:
    """Bytes per optimizer step each GPU's collectives move, by primitive (bus convention: an all-reduce of
    S bytes counts 2·S, an all-gather its gathered output, a reduce-scatter its full input).

    ddp: all-reduce of trainable grads at the step. zero1 / zero2: DeepSpeed (0.19.8,
    runtime/zero/stage_1_and_2.py ``average_tensor``) reduces each gradient bucket with an **all-reduce**
    (``use_multi_rank_bucket_allreduce`` defaults to True, zero/config.py), then keeps its partition: at the
    step (zero1) or every micro-batch (zero2), + the all-gather of the updated params at the step
    (runtime/utils.py ``all_gather_into_tensor_dp_groups``). shard_grad_op: reduce-scatter every micro-batch
    and gathers all params once per micro-batch. zero3/full_shard: every micro-batch gathers all weights in
    forward and again in backward (ZeRO-3: and in recomputation; FSDP2's recomputes under the backward's
    gather, counted: 6 + 5 per step as without) + reduce-scatters grads (FSDP2: _fully_shard/_fsdp_collectives.py):
    every micro-batch, but once per step for FSDP under accelerate's ``no_sync`` (``fsdp_sync_each_batch=false``:
    the micro-batches' gradients held unsharded until the last one)."""
    eng = engine_cost(engine_kind, fsdp)
    if not eng.weight_gathers:  # DDP, ZeRO-1/2: all-reduced gradients (+ ZeRO's updated partitions gathered)
        reduced = {"all_reduce": (ga if eng.reduces_every_micro_batch else 1) * 2.0 * p_t * g_b}
        return {**reduced, "all_gather": p_t * w_b} if eng.gathers_updated_params else reduced
    if not eng.shards_parameters:  # SHARD_GRAD_OP
        return {"reduce_scatter": ga * p_t * g_b, "all_gather": ga * weight_bytes_all}
    gathers = float(eng.weight_gathers + (1 if checkpointing and eng.regathers_in_recompute else 0))
    # FSDP under accelerate's no_sync (memfit.estimate.peak) reduce-scatters once, at the last micro-batch
    reductions = 1 if fsdp and no_sync else ga
    return {"all_gather": ga * gathers * weight_bytes_all, "reduce_scatter": reductions * p_t * g_b}


def fsdp2_copy_bytes(engine_kind: str, gather_bytes: float, n: int, p_t: float, g_b: float, e: float, ga: int,
                     no_sync: bool = False) -> float:
    """HBM bytes FSDP2 moves per optimizer step around its collectives that FSDP1 does not (pinned torch,
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). Each all-gather: ``all_gather_copy_in``
    copies the local shards into one input buffer (read + write the shard) and ``foreach_all_gather_copy_out``
    → ``split_with_sizes_copy`` copies the gathered buffer out into every parameter's own tensor (read +
    write the whole unit); each reduce-scatter: ``foreach_reduce_scatter_copy_in`` → ``chunk_cat`` lays the
    unsharded gradients out by rank in the reduce dtype (read the gradients + write them). FSDP1 gathers into
    the FlatParameter the views already point at and reduce-scatters the flat gradient in place: none of it.
    Gathers per micro-batch as :func:`comm_parts` counts them (full_shard 2, shard_grad_op 1)."""
    gathers = float(engine_cost(engine_kind, True).weight_gathers)
    per_gather = 2.0 * gather_bytes / n + 2.0 * gather_bytes
    return ga * gathers * per_gather + (1 if no_sync else ga) * p_t * (e + g_b)  # reductions as comm_parts


def collective_calls(engine_kind: str, layers: int, nbytes: float, ga: int, checkpointing: bool,
                     tensors: float = 0.0, p_t: float = 0.0, reduce_bucket: float = 0.0, fsdp: bool = False,
                     no_sync: bool = False) -> float:
    """Collective launches per step: one per bucket, and per layer for the sharded engines' gathers.

    DeepSpeed ZeRO-1/2 (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads`` /
    ``allreduce_and_scatter``) flushes its gradient bucket of ``reduce_bucket_size`` elements (memfit's
    default h², HF's 'auto') and all-reduces slices of at most one bucket, a parameter larger than the
    bucket alone: min(trainable tensors, P_t / bucket) all-reduces per reduction (counted on a 2-rank gloo
    run of a 39-tensor h-256 Llama: 37-41 per step), + the all-gather of the updated parameters. FSDP2, L + 2
    groups as accelerate wraps (fsdp_utils.py: layers, input embedding, [norm, lm_head]): per micro-batch a
    gather per group, again in backward but the tail's (full_shard), a reduce-scatter per group (11 + 6), the
    reduce-scatters once per step under no_sync."""
    eng = engine_cost(engine_kind, fsdp)
    if fsdp and eng.weight_gathers:  # a gather per group (full_shard: again in backward, but the tail's)
        groups = layers + 2
        return float(ga * (groups + (groups - 1) * (eng.weight_gathers - 1)) + (1 if no_sync else ga) * groups)
    if eng.reduce_bucket_slices and reduce_bucket > 0 and tensors > 0:
        per = min(tensors, math.ceil(p_t / reduce_bucket))
        return float((ga if eng.reduces_every_micro_batch else 1) * per + 1)
    calls = math.ceil(nbytes / BUCKET_BYTES) if nbytes > 0 else 0
    calls += ga * layers * eng.layer_launches[1 if checkpointing else 0]
    return float(calls)


def overlap_for(engine_kind: str, profile: TimeProfile, cpu: bool = False) -> float:
    """The share of the micro-batches' device time behind which the engine's collectives can run (GPUs), or
    the share of them hidden (CPU processes: none, gloo shares the cores)."""
    if cpu:
        return profile.overlap_cpu_comm
    return getattr(profile, engine_cost(engine_kind).overlap)


def exposed_comm(comm_s: float, device_s: float, engine_kind: str, profile: TimeProfile, cpu: bool,
                 layers: int) -> float:
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
