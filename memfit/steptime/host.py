"""The host's side of a micro-batch on a GPU: PyTorch eager dispatches every op and launches its kernels from
Python; when that takes longer than the device's work, the GPU waits (a micro-batch costs the longer of the
two). Counted in module-level ops, forward + backward, as the CPU model counts them
(memfit.steptime.work.ops_per_layer: transformers' decoder layer + PEFT's adapter wrappers), each at
``gpu_host_op_seconds``; plus bitsandbytes' Linear4bit calls (its Python, quant-state handling,
dequantize + matmul per call: ``qlora_call_ops``), and the sharded engines' per-module hooks: FSDP's
pre/post forward and backward hooks per wrapped unit (decoder layers + the embedding + the tail:
``fsdp_unit_ops``), DeepSpeed ZeRO-3's fetch / release per submodule (``zero3_module_ops``: these
synchronise with the device, so they add to it: :func:`engine_hook_seconds`).

Anchors (docs/gpu-time.md): an eager step of 1,185 kernels took 53.7 ms of host time for 7.3 ms of GPU work
(facebookresearch/sam2#768); memfit's H200 calibration measured 1.9-3.0 ms of host time per Llama decoder
layer (h 2048) forward + backward under autocast, 0.23-0.61 ms per LoRA adapter (bench/results).
"""

from __future__ import annotations

from memfit.engines import engine_cost
from memfit.steptime.ops import Dispatch, EngineHooks
from memfit.steptime.work import RECOMPUTE_DISPATCH
from memfit.steptime.constants import TimeProfile

MODULES_PER_LAYER_EXTRA = 6  # besides the linears and norms: the layer, attention, MLP, activation, rotary, dropout


def dispatch_ops(op: Dispatch, profile: TimeProfile) -> float:
    """Module-level host ops of one micro-batch, forward + backward: each layer's ops, and under checkpointing
    the recompute at ``gc_host_fraction`` of them (torch.utils.checkpoint's machinery costs more than the
    forward it repeats); PEFT's wrappers again at the forward's dispatch share; bitsandbytes' Linear4bit calls at
    ``qlora_call_ops`` each; the model's own outside the layers; the method's own."""
    L, gc = op.layers, op.recompute
    ops = L * (op.layer_ops * (1.0 + (profile.gc_host_fraction if gc else 0.0))
               + op.adapter_ops * (1.0 + (RECOMPUTE_DISPATCH if gc else 0.0))) + op.model_ops
    ops += profile.qlora_call_ops * L * op.quantized_calls * (1.5 if gc else 1.0)
    return ops + op.extra_ops


def engine_hook_seconds(op: EngineHooks, profile: TimeProfile) -> tuple[float, float]:
    """(host, serial) seconds of the engine's hooks per micro-batch: FSDP's ``fsdp_unit_ops`` per wrapped unit
    and DeepSpeed ZeRO-1/2's ``deepspeed_grad_ops`` per trainable tensor and reduction (counted on CPU runs in
    small-op costs: memfit.steptime.engine_host; priced at ``cpu_op_seconds``, the unit they were counted in);
    DeepSpeed ZeRO-3's fetch / release per submodule and pass. Those do not hide under the device's work: the
    coordinator keeps at most two fetches in flight and synchronises the host on the oldest beyond that
    (deepspeed 0.19 runtime/zero/partitioned_param_coordinator.py: ``__max_ongoing_fetch_events = 2``,
    ``popleft().synchronize()``), so the host cannot run ahead of the device by more than that."""
    p = profile
    host = p.fsdp_unit_ops * op.units * p.gpu_host_op_seconds + p.deepspeed_grad_ops * op.grad_tensors \
        * p.cpu_op_seconds
    return host, p.zero3_module_ops * op.fetch_modules * p.gpu_host_op_seconds


def step_host_seconds(engine: str, grad_tensors: float, profile) -> float:
    """Host seconds of the engine's optimizer step beyond AdamW: DeepSpeed ZeRO-1/2's bookkeeping per
    trainable tensor (``deepspeed_step_ops`` small-op costs: the gradient norm per tensor, the flat
    partition's copies, timers); the step waits for it."""
    return profile.deepspeed_step_ops * grad_tensors * profile.cpu_op_seconds if engine_cost(engine).tensor_hooks \
        else 0.0
