"""Thin adapter over the model and hardware specs: the few facts the planner's rules need.

The specs (memfit.spec.model / memfit.spec.hardware) are owned elsewhere; reading them through these
functions keeps the rules readable and in one place if a field is renamed.
"""

from __future__ import annotations

from typing import Any, Optional

# Linear layer names by architecture family, used to check LoRA targets and to pick "all linear".
_LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED_QKV_LINEARS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
_LINEARS_BY_TYPE = {
    "llama": _LLAMA_LINEARS,
    "mistral": _LLAMA_LINEARS,
    "qwen2": _LLAMA_LINEARS,
    "qwen3": _LLAMA_LINEARS,
    "gemma": _LLAMA_LINEARS,
    "gemma2": _LLAMA_LINEARS,
    "falcon": _FUSED_QKV_LINEARS,
    "gpt_neox": _FUSED_QKV_LINEARS,
}


def _first(obj: Any, names: tuple[str, ...], default: Any = None) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return default


# ---- model -------------------------------------------------------------------------------------

def model_name(model: Any) -> str:
    return str(_first(model, ("name",), "model"))


def model_type(model: Any) -> str:
    return str(_first(model, ("family", "model_type"), "")).lower()


def linear_names(model: Any) -> tuple[str, ...]:
    """Names of the model's adaptable linear layers (what LoRA's target_modules can match)."""
    names = getattr(model, "linear_names", None)
    if callable(names):
        return tuple(names())
    if names:
        return tuple(names)
    return _LINEARS_BY_TYPE.get(model_type(model), ())


def hidden_size(model: Any) -> int:
    return int(_first(model, ("hidden", "hidden_size"), 0))


def num_layers(model: Any) -> int:
    return int(_first(model, ("layers", "num_layers", "num_hidden_layers"), 0))


# ---- hardware ----------------------------------------------------------------------------------

def gpu(hardware: Any) -> Any:
    return getattr(hardware, "gpu", hardware)


def gpu_name(hardware: Any) -> str:
    return str(_first(gpu(hardware), ("name",), "GPU"))


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
    return float(_first(gpu(hardware), ("memory_bytes", "mem_bytes"), 0))


def world_size(hardware: Any) -> int:
    return int(_first(hardware, ("world_size",), 1))


def nodes(hardware: Any) -> int:
    return int(_first(hardware, ("nodes",), 1))


def gpus_per_node(hardware: Any) -> int:
    return int(_first(hardware, ("gpus_per_node",), 1))


def cpu_ram_bytes(hardware: Any) -> Optional[float]:
    value = _first(hardware, ("cpu_ram_bytes",))
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
