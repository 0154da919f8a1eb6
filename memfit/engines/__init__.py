"""The engines' costs as a registry: ``ENGINE_COSTS[strategy.engine]`` is one
:class:`~memfit.engines.cost.EngineCost`, the facts memory and time pricing read (what is sharded, which
collectives run how often, the engine's hooks and buffers). Plain Python, below the pricing layers;
``memfit.distributed.engines`` (which runs the engines) is keyed by the same names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Union

from memfit.engines.cost import EngineCost

DDP = EngineCost(name="ddp", kind="ddp", family="ddp")

ZERO1 = EngineCost(
    name="zero1", kind="zero1", family="deepspeed", shards_optimizer=True, autocast=False, casts_module=True,
    master_partition=True, fused_adam=True, fp32_grad_copy=True, gathers_updated_params=True,
    reduce_bucket_slices=True, overlap="overlap_zero12", tensor_hooks=True)

ZERO2 = replace(ZERO1, name="zero2", kind="zero2", shards_gradients=True, reduces_every_micro_batch=True,
                layer_launches=(1, 1))

ZERO3 = EngineCost(
    name="zero3", kind="zero3", family="deepspeed", shards_optimizer=True, shards_gradients=True,
    shards_parameters=True, stores_sharded=True, autocast=False, casts_module=True, master_partition=True,
    fp32_params_are_master=True, fused_adam=True, fp32_grad_copy=True, grad_copy_per_sub_group=True,
    grad_reduce="reduce_scatter",
    reduces_every_micro_batch=True, weight_gathers=2, regathers_in_recompute=True, layer_launches=(3, 4),
    overlap="overlap_zero3", module_fetch_hooks=True, loss_recomputes_head=True, flat_grad_buffer=True,
    partitioned_loading=True)

FSDP_FULL = EngineCost(
    name="fsdp-full_shard", kind="zero3", family="fsdp", fsdp_version=2, shards_optimizer=True,
    shards_gradients=True, shards_parameters=True, stores_sharded=True, autocast=False, gathers_compute_copy=True,
    grad_reduce="reduce_scatter", reduces_every_micro_batch=True, weight_gathers=2, layer_launches=(3, 3),
    overlap="overlap_zero3", unit_hooks=True, pinned_offload=True)

FSDP_SGO = replace(FSDP_FULL, name="fsdp-shard_grad_op", kind="sgo", shards_parameters=False,
                   keeps_unsharded_params=True, weight_gathers=1, layer_launches=(1, 1), overlap="overlap_zero12")

ENGINE_COSTS: dict[str, EngineCost] = {e.name: e for e in (
    DDP, ZERO1, ZERO2, ZERO3, FSDP_FULL, FSDP_SGO,
    replace(FSDP_FULL, name="fsdp1-full_shard", fsdp_version=1),
    replace(FSDP_SGO, name="fsdp1-shard_grad_op", fsdp_version=1),
)}

# The kinds memfit.steptime's step still passes (memfit.estimate's StepInputs.engine, with its ``fsdp`` flag;
# 'fsdp' alone for the host's hooks): FSDP1 and FSDP2 price their collectives and hooks alike
_KINDS = {"sgo": FSDP_SGO, "fsdp": FSDP_FULL}
_FSDP_KINDS = {"zero3": FSDP_FULL, "sgo": FSDP_SGO, "fsdp": FSDP_FULL}


def engine_cost(engine: Union[str, EngineCost], fsdp: bool = False) -> EngineCost:
    """The record for ``engine``: a record as is, a ``Strategy.engine`` name, or a sharding kind (``fsdp``:
    the kind is an FSDP engine's)."""
    if isinstance(engine, EngineCost):
        return engine
    hit = _FSDP_KINDS.get(engine) if fsdp else None
    return hit or _KINDS.get(engine) or ENGINE_COSTS[engine]


__all__ = ["ENGINE_COSTS", "EngineCost", "engine_cost"]
