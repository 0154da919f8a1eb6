"""EngineCost: what one engine does to a training step's memory and time, as the pricing code asks it.

Plain Python, no torch, imports nothing of memfit: ``memfit.estimate`` (memory) and ``memfit.steptime``
(time) read these facts instead of comparing engine names. The engines themselves (their configs, launch,
saving) are ``memfit.distributed.engines``; each record here is keyed by the same ``Strategy.engine``.
Each field says where its fact comes from (the engine's source, or memfit's measurement of it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCost:
    """One engine's memory and time behaviour (the defaults are plain DDP's)."""

    name: str                            # Strategy.engine: the key of memfit.distributed.engines.ENGINES
    kind: str                            # the sharding kind memfit.steptime's step still passes: ddp | zero1 |
    #                                      zero2 | zero3 (every state sharded) | sgo (FSDP SHARD_GRAD_OP)
    family: str                          # whose runtime: ddp | deepspeed | fsdp (for people: nothing prices it)
    fsdp_version: int = 0                # 1: FullyShardedDataParallel (FlatParameter), 2: fully_shard; 0: no FSDP

    # ---- what is sharded across the ranks
    shards_optimizer: bool = False       # optimizer states partitioned (ZeRO-1+, FSDP: the sharded parameters')
    shards_gradients: bool = False       # gradients partitioned (ZeRO-2/3 stage_1_and_2.py / stage3.py, FSDP)
    shards_parameters: bool = False      # weights gathered per unit for forward and again for backward, resharded
    #                                      after each (ZeRO-3 stage3.py, FULL_SHARD reshard_after_forward)
    stores_sharded: bool = False         # the weights rest sharded (ZeRO-3; FSDP in either mode: flat / DTensor shards)
    keeps_unsharded_params: bool = False  # SHARD_GRAD_OP: the gathered parameters kept from forward to backward

    # ---- dtypes and the optimizer
    autocast: bool = True                # torch autocast on the module's own weights, as the HF Trainer runs DDP:
    #                                      16-bit copies cached per forward, gradients reduced in their own dtype.
    #                                      False: the engine hands 16-bit parameters in (DeepSpeed's 16-bit module,
    #                                      FSDP's MixedPrecision) and reduces gradients in the compute dtype
    casts_module: bool = False           # DeepSpeed casts the whole module, PEFT's fp32 adapters included, to 16-bit
    #                                      (runtime/engine.py ``_configure_distributed_model``: half() / bfloat16())
    master_partition: bool = False       # a flat fp32 master partition beside the 16-bit module, which the optimizer
    #                                      steps (stage_1_and_2.py ``single_partition_of_fp32_groups``; stage3.py)
    fp32_params_are_master: bool = False  # in fp32 the partitioned parameters are the master, no copy (ZeRO-3:
    #                                      bench/distributed_memory.py measured 18.9 MB where a copy makes 25.2 MB)
    fused_adam: bool = False             # the engine's own fused Adam: no foreach sqrt(v) temporary (DeepSpeed)
    fp32_grad_copy: bool = False         # the step copies the 16-bit gradient partition to fp32 (DeepSpeed ZeRO)
    grad_copy_per_sub_group: bool = False  # ... one sub-group at a time, freed after its update (ZeRO-3,
    #                                      deepspeed 0.19.8 stage3.py ``_prepare_fp32_grad_for_sub_group`` and
    #                                      ``_release_sub_group``; ZeRO-1/2 copy each parameter group's whole
    #                                      partition: stage_1_and_2.py:3126)
    gathers_compute_copy: bool = False   # gathers in the compute dtype (FSDP MixedPrecision param_dtype), not storage

    # ---- collectives
    grad_reduce: str = "all_reduce"      # the gradients' collective: all_reduce (DDP; ZeRO-1/2 with
    #                                      use_multi_rank_bucket_allreduce, zero/config.py) | reduce_scatter
    reduces_every_micro_batch: bool = False  # per micro-batch (ZeRO-2, ZeRO-3, FSDP) or once per step (DDP under
    #                                      the Trainer's no_sync, ZeRO-1 at its step)
    gathers_updated_params: bool = False  # all-gathers the updated partitions after the step (ZeRO-1/2:
    #                                      runtime/utils.py ``all_gather_into_tensor_dp_groups``; allgather bucket)
    weight_gathers: int = 0              # whole-weight gathers per micro-batch: forward + backward (FULL_SHARD,
    #                                      ZeRO-3) 2, SHARD_GRAD_OP 1 (_fully_shard/_fsdp_collectives.py)
    regathers_in_recompute: bool = False  # gathers again in checkpointing's recompute (DeepSpeed ZeRO-3; FSDP2
    #                                      recomputes under the backward's gather)
    layer_launches: tuple[int, int] = (0, 0)  # collective launches per decoder layer and micro-batch beyond the
    #                                      bucketed ones, (without, with checkpointing): ZeRO-3's gathers and
    #                                      reduce-scatter (+ the recompute's gather), ZeRO-2 / SHARD_GRAD_OP one
    reduce_bucket_slices: bool = False   # all-reduces slices of at most one reduce bucket (ZeRO-1/2,
    #                                      stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``)
    overlap: str = "overlap_ddp"         # the Profile constant: the share of device time its collectives hide behind

    # ---- host work
    tensor_hooks: bool = False           # per trainable tensor: gradient hooks in backward, bookkeeping in the step
    #                                      (ZeRO-1/2 stage_1_and_2.py; counted in memfit.steptime.engine_host)
    unit_hooks: bool = False             # pre/post forward and backward hooks per wrapped unit (FSDP)
    module_fetch_hooks: bool = False     # fetch / release per submodule that synchronise with the device (ZeRO-3
    #                                      partitioned_param_coordinator.py ``__max_ongoing_fetch_events = 2``)

    # ---- memory specifics
    loss_recomputes_head: bool = False   # loss=chunked recomputes the head in backward: the partitioned head weight
    #                                      is gathered only by the module call (DeepSpeed ZeRO-3; memfit.train.loss)
    flat_grad_buffer: bool = False       # the gradient partitions' flat buffer, allocated once and live in every
    #                                      phase (ZeRO-3 stage3.py ``grad_partitions_flat_buffer``)
    pinned_offload: bool = False         # parameter offload into pinned host blocks (FSDP; memfit.estimate.pinned)
    partitioned_loading: bool = False    # loads one checkpoint shard at a time (DeepSpeed ZeRO-3's zero.Init)
