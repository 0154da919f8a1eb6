"""The host's side of a micro-batch on a GPU: PyTorch eager dispatches every op and launches its kernels from
Python; when that takes longer than the device's work, the GPU waits (a micro-batch costs the longer of the
two). Counted in module-level ops, forward + backward, as the CPU model counts them
(memfit.steptime.work.ops_per_layer: transformers' decoder layer + PEFT's adapter wrappers), each at
``gpu_host_op_seconds``; plus bitsandbytes' Linear4bit calls (its Python, quant-state handling,
dequantize + matmul per call: ``qlora_call_ops``), and the sharded engines' per-module hooks: FSDP's
pre/post forward and backward hooks per wrapped unit (decoder layers + the embedding + the tail:
``fsdp_unit_ops``), DeepSpeed ZeRO-3's fetch / release per submodule (``zero3_module_ops``: these
synchronise with the device, so they add to it: :func:`zero3_hook_seconds`).

Anchors (docs/gpu-time.md): an eager step of 1,185 kernels took 53.7 ms of host time for 7.3 ms of GPU work
(facebookresearch/sam2#768); memfit's H200 calibration measured 1.9-3.0 ms of host time per Llama decoder
layer (h 2048) forward + backward under autocast, 0.23-0.61 ms per LoRA adapter (bench/results).
"""

from __future__ import annotations

from memfit.engines import engine_cost
from memfit.spec.model import ModelSpec
from memfit.steptime.work import RECOMPUTE_DISPATCH, ops_per_layer
from memfit.steptime.constants import TimeProfile

MODULES_PER_LAYER_EXTRA = 6  # besides the linears and norms: the layer, attention, MLP, activation, rotary, dropout


def zero3_hook_seconds(model: ModelSpec, gc: bool, profile) -> float:
    """DeepSpeed ZeRO-3's fetch / release hooks per submodule and pass. They do not hide under the device's
    work: the coordinator keeps at most two fetches in flight and synchronises the host on the oldest
    beyond that (deepspeed 0.19 runtime/zero/partitioned_param_coordinator.py: ``__max_ongoing_fetch_events
    = 2``, ``popleft().synchronize()``), so the host cannot run ahead of the device by more than that."""
    redo = 1.0 + (RECOMPUTE_DISPATCH if gc else 0.0)
    modules = len(model.linears) + model.norms_per_layer + MODULES_PER_LAYER_EXTRA
    return profile.zero3_module_ops * modules * model.layers * redo * profile.gpu_host_op_seconds


def host_seconds(model: ModelSpec, adapted: int, eager: bool, gc: bool, qlora: bool, engine: str, profile: TimeProfile,
                 grad_tensors: float = 0.0, ga: int = 1) -> float:
    """Host seconds of one micro-batch: its module-level ops, forward + backward (+ the recomputed forward),
    at ``gpu_host_op_seconds``, and DeepSpeed ZeRO-1/2's gradient hooks in the backward
    (``deepspeed_grad_ops`` per trainable tensor per reduction, counted on CPU runs in small-op costs:
    memfit.steptime.engine_host; priced at ``cpu_op_seconds``, the unit they were counted in): every
    micro-batch under ZeRO-2, once per step under ZeRO-1 (here its share per micro-batch)."""
    hooks, eng = 0.0, engine_cost(engine)
    if eng.tensor_hooks:
        hooks = profile.deepspeed_grad_ops * grad_tensors / (1.0 if eng.reduces_every_micro_batch else max(1, ga))
    return host_ops(model, adapted, eager, gc, qlora, engine, profile) * profile.gpu_host_op_seconds \
        + hooks * profile.cpu_op_seconds


def host_ops(model: ModelSpec, adapted: int, eager: bool, gc: bool, qlora: bool, engine: str, profile) -> float:
    """Module-level host ops of one micro-batch, forward + backward (+ under checkpointing, the recompute at
    ``gc_host_fraction`` of a layer's ops: torch.utils.checkpoint's machinery costs more than the forward
    it repeats)."""
    L, base = model.layers, ops_per_layer(model, 0, eager)
    adapters = ops_per_layer(model, adapted, eager) - base  # PEFT's wrappers: their forward again, as measured.py
    ops = L * (base * (1.0 + (profile.gc_host_fraction if gc else 0.0))
               + adapters * (1.0 + (RECOMPUTE_DISPATCH if gc else 0.0))) + 20.0
    if qlora:
        ops += profile.qlora_call_ops * L * sum(x.count for x in model.linears) * (1.5 if gc else 1.0)
    if engine_cost(engine).unit_hooks:
        ops += profile.fsdp_unit_ops * (L + 2)
    return ops


def step_host_seconds(engine: str, grad_tensors: float, profile) -> float:
    """Host seconds of the engine's optimizer step beyond AdamW: DeepSpeed ZeRO-1/2's bookkeeping per
    trainable tensor (``deepspeed_step_ops`` small-op costs: the gradient norm per tensor, the flat
    partition's copies, timers); the step waits for it."""
    return profile.deepspeed_step_ops * grad_tensors * profile.cpu_op_seconds if engine_cost(engine).tensor_hooks \
        else 0.0
