"""FSDP1 (``FullyShardedDataParallel``, FlatParameter) as accelerate's FSDP plugin runs it (pinned torch 2.13,
accelerate 1.15): what one rank holds. FSDP2 is :mod:`memfit.estimate.fsdp`; one module per engine.

memfit configures FSDP1 as accelerate, fms-hf-tuning, Answer.AI's train.py and the PEFT FSDP + QLoRA guide do
(memfit/distributed/config.py ``fsdp_trainer_config``): TRANSFORMER_BASED_WRAP (one unit per decoder layer;
for adapter methods PEFT's ``fsdp_auto_wrap_policy`` also makes every trainable leaf — lora_A, lora_B — its
own unit), ``use_orig_params=True``, ``limit_all_gathers=True``, ``backward_prefetch=BACKWARD_PRE``, no forward
prefetch, ``sync_module_states`` + ``cpu_ram_efficient_loading``. Paths below are under
``site-packages/torch/distributed/fsdp/`` unless named otherwise. Each term:

- **Flat parameters per unit, padded** (``_flat_param.py`` ``_init_flat_param_and_metadata``): with
  ``use_orig_params`` every original parameter starts at a 16-byte boundary (``_get_aligned_numel``: 16 /
  itemsize of the forward dtype, padding elements inserted before it), then the whole flat parameter is
  padded to a multiple of the world size; each rank keeps numel / world (``_get_shard``). The root unit is
  what no decoder layer holds: embeddings, final norm, head (``flat_param_numel``, ``shard_numel``).
- **The sharded flat parameter and its low-precision shard** (``_flat_param.py`` ``_use_low_precision_shard``
  / ``_free_low_precision_sharded_param``): under a MixedPrecision ``param_dtype`` different from the flat
  parameter's (accelerate upcasts every flat parameter that requires grad to fp32: accelerate/accelerator.py,
  "Upcasted low precision parameters"), ``pre_unshard`` allocates a ``_mp_shard`` (shard numel x param dtype)
  on the device, all-gathers from it and frees it after: one unit's, live while the prefetched unit gathers.
  With CPU offload ``pre_unshard`` copies the CPU shard to the device first (``flat_param_to`` or the
  ``_local_shard.to(device)`` inside ``_use_low_precision_shard``): the same shard-sized transient.
- **Unsharded flat parameters of the current and prefetched units** (``_runtime_utils.py`` ``_unshard``,
  ``_get_handle_to_prefetch``; ``_limiter_utils.py`` ``_FreeEventQueue._max_num_inflight_all_gathers = 2``):
  in backward BACKWARD_PRE gathers the next unit before the current one computes, and the rate limiter lets
  at most two all-gathers run ahead of the frees: ``Profile.gathered_layers`` = 2 decoder layers, at the
  param dtype (``_full_param_padded``). *Which* unit is "next" is the recorded post-forward order
  (``_exec_order_utils.py`` ``get_handle_to_backward_prefetch``: ``handles_post_forward_order[index - 1]``). A
  nested unit finishes its forward before its parent, so with PEFT's adapter units (lora_A / lora_B inside
  every decoder layer) a decoder layer's predecessor is its own last adapter unit: the previous decoder layer
  is gathered only by its own pre-backward hook, after this one's reshard — one decoder layer gathered at a
  time in backward (:func:`backward_layers`; measured on 2 gloo ranks, LoRA with and without checkpointing).
- **The last decoder layer from the backward's first node**: the root's pre-backward hook is registered on
  the root's outputs (``_register_pre_backward_hooks``), the loss among them (transformers computes it inside
  the model's forward when the Trainer passes labels), so it runs before the loss's backward and prefetches
  the root's predecessor in post-forward order — the last decoder layer (``_pre_backward_hook`` ->
  ``_prefetch_handle``). The logits' backward (the start of backward, phase A) holds that layer gathered.
- **A unit's post-backward hook** (``_post_backward_hook``): ``_post_backward_reshard`` frees the unit's own
  unsharded parameters *before* ``_reduce_grad`` makes the padded unsharded gradient's reduce-scatter output,
  and the hook runs once autograd has accumulated the unit's whole gradient — after its backward's working
  set is freed. So the unsharded gradient + reduce-scatter output sit beside the prefetched unit only, not
  beside the layer's backward working memory, and both are freed when ``_reduce_grad`` returns (the padded
  gradient is a local; the shard is kept as ``_saved_grad_shard``).
- **The root unit stays gathered** from the forward's start to the backward's end: ``_post_forward_reshard``
  does not free the root's unsharded flat parameter after forward (``not state._is_root``), and a root whose
  parameters are frozen is resharded only in ``_post_backward_final_callback``. The root holds the
  embedding and the head: for Llama-3.1-70B 2.1e9 parameters, 4.2 GB in bf16 through every layer phase
  (FSDP2 gathers the head only from the loss to its backward and the embedding as its own unit).
- **Gradients** (``_runtime_utils.py`` ``_post_backward_hook``, ``_reduce_grad``): a unit's unsharded
  gradient (padded numel x param dtype) + the reduce-scatter output (shard x reduce dtype) while it is reduced;
  the sharded gradient is cast to the flat parameter's dtype (``_cast_grad_to_param_dtype``) and kept as
  ``_saved_grad_shard`` (the gradients line). With ``use_orig_params`` the original parameters are views
  into the flat parameter (``_use_unsharded_views`` / ``_use_sharded_views``): no bytes of their own. A
  FlatParameter mixing frozen and trainable parameters requires grad as a whole (``_validate_tensors_to_flatten``:
  ``flat_param_requires_grad or tensor.requires_grad``), which is why adapters get their own units (PEFT's
  policy; without it every decoder layer would carry a gradient for all its frozen weights).
- **The root's gradient** (full fine-tuning): the root's original parameters are views split from one flat
  parameter, so autograd holds the head's gradient (param dtype) until the embedding's arrives at the end of
  backward, then makes the root's whole unsharded gradient (``SplitWithSizesBackward``) before the post-backward
  hook reduce-scatters it: the head's gradient through every layer's backward, and at the very end head +
  embedding gradients + the root's unsharded gradient at once.
- **CPU offload** (``CPUOffload(offload_params=True)``; ``_flat_param.py`` ``FlatParamHandle.shard``,
  ``_runtime_utils.py`` ``_post_backward_hook``: ``_cpu_grad``): every unit's shard is pinned and a pinned
  gradient buffer of the same size is allocated beside it — frozen units included — each rounded up to a
  power of two by the pinned allocator (memfit.estimate.pinned); the optimizer states live in host memory too
  (the CPU lines); the device keeps the gathered units and the shard-sized copy above.
- **Rank 0's full CPU copy** (``_init_utils.py`` ``_sync_module_params_and_buffers``; transformers reads
  ``FSDP_CPU_RAM_EFFICIENT_LOADING`` and builds the other ranks on the meta device): one full copy per node at
  the load dtype, in host.py.
- **A reentrant checkpoint around the units keeps every layer's input and its gradient to the backward's
  end.** transformers < 4.52 checkpoints in the model's layer loop (``self._gradient_checkpointing_func(
  decoder_layer.__call__, ...)``, reentrant by default), i.e. *around* each decoder layer's FSDP unit: the
  recompute in backward (torch/utils/checkpoint.py ``CheckpointFunction.backward``) calls the unit's forward
  again on the layer input's detached leaf (``detach_variable``: the same storage), and autograd accumulates
  that leaf's gradient into its ``.grad``. For a frozen unit (a decoder layer once PEFT's policy has put the
  adapters in units of their own) FSDP1 reshards after backward through a ``register_multi_grad_hook`` on that
  leaf (``_runtime_utils.py`` ``_pre_forward`` -> ``_register_post_backward_reshard_only_hook``), whose closure
  holds the leaf's AccumulateGrad node and with it the leaf and its ``.grad`` until ``_finalize_params`` drops
  the hook at the backward's end. memfit prices it under FSDP1 for every method: at the first layer's backward
  every layer's input and every later layer's input gradient are live (:func:`reentrant_retained`;
  ``strategy.hf_legacy_checkpoint``). The CPU cannot isolate the hook: its emulation (bench/distributed_memory.py
  ``+gcl`` cases, transformers 5 with the reentrant checkpoint put around each unit) keeps the detached inputs
  and their gradients to the backward's end for trained units too, and without FSDP at all — while the
  published single-GPU runs with this checkpoint (fms-hf-tuning, no FSDP) read within a few % without the term,
  so it is not priced there. Where the checkpoint sits *inside* the unit (transformers >= 4.52's
  ``GradientCheckpointingLayer``, memfit's trainer; Answer.AI's ``apply_activation_checkpointing`` after
  wrapping) the unit's forward runs once, on the non-leaf input, and nothing is kept (measured: the same peak
  as without the flag). The published 2 x A100 Llama-2-70B QLoRA run (46.7 GB allocated) reads +0.9 % with it
  (−22 % without); on gloo the emulation keeps about one hidden-sized tensor per layer more than this prices
  (docs/distributed.md).
- **QLoRA's quant_storage inside flat parameters**: ``Params4bit`` data stored as ``bnb_4bit_quant_storage``
  (bf16: four NF4 values per element) is flattened with the layer's 16-bit parameters (one dtype per flat
  parameter); its quantisation state is a module attribute, replicated on every rank, as under FSDP2.
"""

from __future__ import annotations

import math
from typing import Iterable

from memfit.spec.model import ModelSpec

ALIGNMENT_BYTES = 16  # _flat_param.py _get_aligned_numel: "This alignment constraint comes from TorchInductor"


def flat_param_numel(numels: Iterable[int], world: int, dtype_bytes: int, use_orig_params: bool = True) -> int:
    """Elements of one unit's padded unsharded FlatParameter (_flat_param.py ``_init_flat_param_and_metadata``):
    each parameter aligned to 16 bytes of the forward dtype, then the total padded to a multiple of ``world``
    (both only with ``use_orig_params``; without, ``_get_shard`` pads the last rank's chunk to the same size)."""
    align = ALIGNMENT_BYTES // int(dtype_bytes) if use_orig_params else 0
    total = 0
    for n in numels:
        if align and total % align:
            total += align - total % align
        total += int(n)
    if not align:
        return math.ceil(total / world) * world
    return total + (world - total % world) % world


def shard_numel(numels: Iterable[int], world: int, dtype_bytes: int, use_orig_params: bool = True) -> int:
    """Elements each rank keeps of one unit (``_get_shard``: the padded flat parameter / world)."""
    return flat_param_numel(numels, world, dtype_bytes, use_orig_params) // world


def layer_numels(model: ModelSpec) -> list[int]:
    """A decoder layer's parameters in the order a Llama-style block registers them (attention and MLP linears,
    then the norms); the alignment padding depends on it only when a size is not a multiple of 16 bytes."""
    out = []
    for lin in model.linears:
        for _ in range(lin.count):
            out.append(lin.in_features * lin.out_features)
            if lin.bias:
                out.append(lin.out_features)
    norm = model.hidden * (2 if model.norm == "layernorm" else 1)
    out += [norm] * model.norms_per_layer
    rest = model.layer_parameters - sum(out)
    if rest > 0:  # qk-norms, router, anything else the layer owns
        out.append(rest)
    return out


def root_parameters(model: ModelSpec) -> float:
    """Parameters of the root unit: everything no decoder layer holds (embeddings, final norm, head)."""
    return float(model.parameters - model.layers * model.layer_parameters)


def padding_bytes(model: ModelSpec, world: int, dtype_bytes: int) -> float:
    """Per rank: the padding FSDP1 adds to the decoder layers' and the root's flat parameters (alignment +
    world-size divisibility), at the flat parameter's dtype."""
    layer = flat_param_numel(layer_numels(model), world, dtype_bytes) - model.layer_parameters
    root_p = int(root_parameters(model))
    head = model.head_parameters
    root = flat_param_numel([root_p - head, head] if head else [root_p], world, dtype_bytes) - root_p
    return (model.layers * layer + root) * dtype_bytes / world


def backward_layers(adapter_units: bool, gathered_layers: float) -> float:
    """Decoder layers gathered at once while a layer runs backward: the current + BACKWARD_PRE's prefetched
    (``gathered_layers``, 2) where decoder layers follow each other in post-forward order, 1 where each holds
    nested adapter units — the prefetch then targets the layer's own last adapter unit (module docstring).
    ``adapter_units``: the method's ``fsdp_adapter_units`` (memfit's FSDP1 engine installs PEFT's
    fsdp_auto_wrap_policy for it: memfit/distributed/engines/fsdp.py ``prepare_trainer``)."""
    return 1.0 if adapter_units else gathered_layers


def root_unit(model: ModelSpec, half: float) -> tuple[float, float]:
    """(bytes of the gathered root unit, bytes of the head's gradient autograd holds until the end of backward)
    at the param dtype ``half``."""
    head = model.head_parameters or model.embedding_parameters
    norm = model.hidden * (2 if model.norm == "layernorm" else 1)
    return root_parameters(model) * half, (head + norm) * half


def reentrant_retained(gc: bool, around_units: bool, act_in: float, layers: int) -> float:
    """Bytes live at the first layer's backward beyond what checkpointing keeps there (its own input), under a
    reentrant checkpoint around the decoder units (module docstring): the other layers' inputs and their
    gradients, at the residual stream's dtype like ``act_in`` (every layer's input)."""
    if not (gc and around_units):
        return 0.0
    return 2.0 * act_in * (layers - 1) / layers
