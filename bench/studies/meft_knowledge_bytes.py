"""Bytes of bench/studies/meft_knowledge.py: the trainable state each method keeps on the device and on the host,
predicted by memfit's estimator and measured on the tensors a run holds, and bytes moved per step.

"Device-resident trainable state" = trainable parameters + their gradients + optimizer state held by the
device (on this CPU-only machine the "device" is the process's torch tensors that a GPU run would keep
on the GPU: for MEFT its fixed row buffers and the router; the key/value store and its Adam moments are
host state). Activations are not trainable state and are left out of both sides.

Predicted: memfit.estimate.estimate on a catalog GPU (1xA100-80GB, fp32) -- not ``local``, where the
estimator folds MEFT's host store into the CPU "device" -- taking the trainable weights (trainable
parameters x 4 B), the ``gradients`` and ``optimizer`` lines, and for MEFT its fixed buffers
(memfit.methods.meft.memory.meft_memory: buffers minus what the forward saves) and host store.
The dense Parallel Adapter has no method in memfit's estimator: its figure is 16 B per parameter
(fp32 weight, gradient, two Adam moments), the same rule the estimator applies to LoRA.
"""

from __future__ import annotations

from typing import Any, Optional

HARDWARE = "1xA100-80GB"


def _tensors_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensors_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensors_bytes(v) for v in obj)
    return 0


def device_params(model) -> list:
    """The trainable nn.Parameters (LoRA's A/B, all weights for full, MEFT's routers)."""
    return [p for p in model.parameters() if p.requires_grad]


def measured_grad_bytes(model) -> int:
    """Gradients of the trainable device parameters, read just before the optimizer step."""
    return sum(_tensors_bytes(p.grad) for p in device_params(model) if p.grad is not None)


def measured_optimizer_bytes(model, optimizer) -> int:
    """Optimizer state of the device parameters (MEFT's tables' moments are host state: left out)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the Trainer's optimizer
    state = getattr(inner, "state", {})
    return sum(_tensors_bytes(state[p]) for p in device_params(model) if p in state)


def measured(model, optimizer, grad_bytes: int, method: str) -> dict:
    """{device_bytes, host_bytes, parts} measured on the live tensors of a run after an optimizer step."""
    params = sum(_tensors_bytes(p.data) for p in device_params(model))
    opt = measured_optimizer_bytes(model, optimizer)
    parts = {"params": params, "grads": grad_bytes, "optimizer": opt, "meft_buffers": 0}
    host = 0
    if method == "meft":
        from memfit.meft import meft_state

        st = meft_state(model)
        parts["meft_buffers"] = st["device_bytes"] - sum(  # device_bytes = buffers + router weights
            p.numel() * 4 for p in device_params(model))
        host = st["cpu_bytes"]
    return {"device_bytes": sum(parts.values()), "host_bytes": host, "parts": parts}


def dense_adapter_measured(layers: int, hidden: int, neurons: int, tokens: int = 64) -> dict:
    """A dense Parallel Adapter of ``neurons`` key-value pairs per layer, built as device tensors
    (W_K, W_V as nn.Parameters), one forward/backward and one torch AdamW step; its tensors summed."""
    import torch

    params = [torch.nn.Parameter(torch.randn(neurons, hidden) * 0.02) for _ in range(2 * layers)]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    x = torch.randn(tokens, hidden)
    for i in range(layers):
        k, v = params[2 * i], params[2 * i + 1]
        (torch.relu(x @ k.t()) @ v).pow(2).sum().backward()
    grads = sum(_tensors_bytes(p.grad) for p in params)
    opt.step()
    state = sum(_tensors_bytes(opt.state[p]) for p in params)
    data = sum(_tensors_bytes(p.data) for p in params)
    return {"device_bytes": data + grads + state, "host_bytes": 0,
            "parts": {"params": data, "grads": grads, "optimizer": state, "meft_buffers": 0}}


def predicted(run, dense_neurons: Optional[int] = None) -> dict:
    """The estimator's device and host bytes of trainable state (and MEFT's bytes moved per step)."""
    from memfit.estimate.estimate import estimate
    from memfit.estimate.setup import profile_for
    from memfit.methods.meft.memory import meft_memory
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model

    model = resolve_model(run.model)
    if dense_neurons is not None:  # the dense Parallel Adapter: 16 B per parameter on the device
        n = 2 * model.layers * dense_neurons * model.hidden
        return {"device_bytes": 16 * n, "host_bytes": 0, "moved_bytes": 0, "trainable": n,
                "basis": "16 B/param (fp32 weight + gradient + 2 Adam moments); no PA method in the estimator"}
    strategy = run.strategy
    est = estimate(model, parse_hardware(HARDWARE), strategy)
    trainable_dev = est.trainable_parameters
    out = {"moved_bytes": 0, "basis": f"memfit.estimate on {HARDWARE}, fp32"}
    if strategy.method == "meft":
        profile = profile_for(None, model, strategy, None, None, 0.05)
        buf, saved, host, _ = meft_memory(model, strategy, profile, 4.0, on_cpu=False)
        router = est.trainable_parameters - 2 * model.layers * strategy.meft_neurons * model.hidden
        trainable_dev = router
        out["device_bytes"] = 4 * router + est.gpu["gradients"] + est.gpu["optimizer"] + (buf - saved)
        out["host_bytes"] = host
        out["moved_bytes"] = float(est.traffic["h2d"] + est.traffic["d2h"])
    else:
        out["device_bytes"] = 4 * trainable_dev + est.gpu["gradients"] + est.gpu["optimizer"]
        out["host_bytes"] = 0
    out["trainable"] = est.trainable_parameters
    return out

