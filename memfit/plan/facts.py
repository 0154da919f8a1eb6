"""Thin adapter over the model and hardware specs: the few facts the planner's rules need.

The specs (memfit.spec.model / memfit.spec.hardware) are owned elsewhere; reading them through these
functions keeps the rules readable and in one place if a field is renamed.
"""

from __future__ import annotations

from typing import Any, Optional

# ---- model (memfit.spec.model.ModelSpec) ----------------------------------------------------------

def model_name(model: Any) -> str:
    return str(getattr(model, "name", "model"))


def linear_names(model: Any) -> tuple[str, ...]:
    """Names of one decoder layer's linear modules (what LoRA's target_modules can match)."""
    names = getattr(model, "linear_names", None)
    return tuple(names()) if callable(names) else tuple(names or ())


def hidden_size(model: Any) -> int:
    return int(getattr(model, "hidden", 0))


def num_layers(model: Any) -> int:
    return int(getattr(model, "layers", 0))


# ---- hardware (memfit.spec.hardware.HardwareSpec) -----------------------------------------------

def gpu(hardware: Any) -> Any:
    return getattr(hardware, "gpu", hardware)


def gpu_name(hardware: Any) -> str:
    return str(getattr(gpu(hardware), "name", "GPU"))


def is_cpu(hardware: Any) -> bool:
    """True for the CPU pseudo-device (``local`` on a machine without CUDA)."""
    return bool(getattr(gpu(hardware), "is_cpu", False))


def supports_bf16(hardware: Any) -> bool:
    g = gpu(hardware)
    return bool(getattr(g, "is_cpu", False) or getattr(g, "bf16", False))


def supports_fa2(hardware: Any) -> bool:
    g = gpu(hardware)
    return not getattr(g, "is_cpu", False) and bool(getattr(g, "fa2", False))


def gpu_memory_bytes(hardware: Any) -> float:
    return float(getattr(gpu(hardware), "memory_bytes", 0))


def world_size(hardware: Any) -> int:
    return int(getattr(hardware, "world_size", 1))


def nodes(hardware: Any) -> int:
    return int(getattr(hardware, "nodes", 1))


def gpus_per_node(hardware: Any) -> int:
    return int(getattr(hardware, "gpus_per_node", 1))


def cpu_ram_bytes(hardware: Any) -> Optional[float]:
    value = getattr(hardware, "cpu_ram_bytes", None)
    return float(value) if value else None


def hardware_text(hardware: Any) -> str:
    """The pool as a user writes it: '8xV100-32GB', '2x8xV100-32GB' or 'local'."""
    if getattr(hardware, "label", "") == "local":
        return "local"
    describe = getattr(hardware, "describe", None)
    if callable(describe):
        return describe()
    base = f"{gpus_per_node(hardware)}x{gpu_name(hardware)}"
    return f"{nodes(hardware)}x{base}" if nodes(hardware) > 1 else base


def with_nodes(hardware: Any, n: int) -> Any:
    """The same pool with ``n`` nodes (each node keeps its GPUs and CPU RAM)."""
    import dataclasses

    return dataclasses.replace(hardware, nodes=n, label="")


def with_gpus_per_node(hardware: Any, k: int) -> Any:
    """The same GPU kind, ``k`` per node; CPU RAM follows the catalog default unless the user gave it."""
    import dataclasses

    from memfit.spec.hardware import default_cpu_ram

    ram = hardware.cpu_ram_bytes if getattr(hardware, "cpu_ram_given", True) else default_cpu_ram(hardware.gpu, k)
    return dataclasses.replace(hardware, gpus_per_node=k, cpu_ram_bytes=ram, label="")
