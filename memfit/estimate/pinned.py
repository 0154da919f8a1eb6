"""FSDP's CPU offload in host memory: the pinned blocks it allocates per rank (both versions), at the sizes
torch's pinned-memory allocator actually hands out. Paths under ``site-packages/torch/`` at the pinned 2.13.

- **The allocator rounds every pinned block up to a power of two**: ``ATen/core/CachingHostAllocator.h``
  ``allocate``: "Round up the allocation to the nearest power of two to improve reuse" whenever the size is
  at most ``pinned_max_round_threshold`` and ``pinned_max_cached_size`` — both unlimited by default
  (``c10/core/AllocatorConfig.h``). ``Tensor.pin_memory()`` and non-blocking device-to-host copies allocate
  through it. A 214 MB shard takes 256 MB; a 143 MB one 256 MB too.
- **FSDP1** (``distributed/fsdp/_flat_param.py`` ``FlatParamHandle.shard``, ``init_flat_param_attributes``):
  every unit's sharded FlatParameter is pinned (``_local_shard.pin_memory()``) and a pinned gradient shard of
  the same size and dtype is pre-allocated beside it (``_cpu_grad = zeros_like(...).pin_memory()``) — for
  every unit, frozen ones included, whatever ``requires_grad`` (QLoRA's NF4 layers get a gradient buffer they
  never use). One block each per decoder layer (its shard: ``numel / world`` of the flat parameter padded to
  a multiple of the world size, ``_get_shard``), per adapter unit (PEFT's ``fsdp_auto_wrap_policy`` makes
  every trainable leaf, lora_A and lora_B, a unit of its own, upcast to fp32 by accelerate) and for the root
  unit (embeddings, final norm, head). So a node's offloaded bytes follow ``world x pinned_block(shard)``,
  not the model's size: a 70B NF4 layer (428 MB) is 214 MB on 2 ranks and 143 MB on 3, both 256 MiB blocks,
  so 3 GPUs pin 1.5 x what 2 do (vLLM #56410 measured the same rounding: ``--cpu-offload-gb`` took ~1.9x).
- **FSDP2** (``distributed/fsdp/_fully_shard/_fsdp_param.py`` ``_init_sharded_param``): every parameter's
  padded shard is pinned on its own (``CPUOffloadPolicy.pin_memory=True``, the default); the reduce-scattered
  gradient of a trained parameter is copied to the host non-blocking (``_fsdp_collectives.py``), a pinned
  block per parameter.
"""

from __future__ import annotations

import math

from memfit.estimate import fsdp1 as F1


def pinned_block(nbytes: float) -> float:
    """Bytes the pinned-memory allocator hands out for a request of ``nbytes`` (the next power of two)."""
    return 0.0 if nbytes <= 0 else 2.0 ** math.ceil(math.log2(nbytes))


def _root_parts(model) -> list[float]:
    """The root's parameters one by one: embedding, head (when untied), final norm."""
    norm = model.hidden * (2 if model.norm == "layernorm" else 1)
    head = model.head_parameters
    return [p for p in (model.embedding_parameters, head, norm) if p]


def adapter_units(model, adapted, rank: int) -> list[int]:
    """Elements of one decoder layer's FSDP1 adapter units (PEFT's ``fsdp_auto_wrap_policy``: every leaf with
    a trainable weight), one lora_A (``rank x in``) and one lora_B (``out x rank``) per adapted linear."""
    return [k for lin in model.linears if lin.name in adapted for _ in range(lin.count)
            for k in (rank * lin.in_features, lin.out_features * rank)]


def _shard_block(unit_bytes: float, n: int) -> float:
    """A unit's pinned shard: the flat parameter padded to a multiple of ``n`` elements (bytes here: at most
    ``n`` elements more), / n, rounded up by the allocator."""
    return pinned_block(math.ceil(unit_bytes / n))


def fsdp_offload(run, layers_bytes: float, root_bytes: float, trained_bytes: float,
                 adapters: tuple = (), trained_in_layers: float = 0.0) -> tuple[float, float]:
    """(pinned parameter shards, pinned gradient shards) per rank under FSDP's CPU offload. ``layers_bytes``:
    the decoder layers' stored bytes (all ranks), ``root_bytes`` the root's, ``trained_bytes`` the trained
    parameters' gradient bytes (all ranks). FSDP1: ``adapters``, one layer's adapter units' elements
    (``adapter_units``; their own units, fp32), whose bytes ``trained_in_layers`` leaves ``layers_bytes``."""
    model, n = run.model, run.world
    if run.fsdp_version == 1:
        layer = _shard_block(max(layers_bytes - trained_in_layers, 0.0) / model.layers, n)
        units = sum(_shard_block(k * 4.0, n) for k in adapters)  # accelerate upcasts trained flat params
        blocks = model.layers * (layer + units) + _shard_block(root_bytes, n)
        return blocks, blocks  # the shard and its _cpu_grad, every unit
    numels = F1.layer_numels(model)
    per_elem = layers_bytes / (model.layers * sum(numels)) if numels else 0.0
    root_parts = _root_parts(model)
    root_elem = root_bytes / sum(root_parts) if root_parts else 0.0
    params = model.layers * sum(pinned_block(k * per_elem / n) for k in numels) + sum(
        pinned_block(k * root_elem / n) for k in root_parts)
    if run.method.trains_base:  # a pinned gradient per trained parameter
        grad_elem = trained_bytes / (model.layers * sum(numels) + sum(root_parts))
        grads = model.layers * sum(pinned_block(k * grad_elem / n) for k in numels) + sum(
            pinned_block(k * grad_elem / n) for k in root_parts)
    else:  # adapters: many small gradients, each its own block (rounded up on average by ~1.4, a small total)
        grads = trained_bytes / n
    return params, grads
