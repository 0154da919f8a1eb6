"""What one rank holds of the model states under DDP / ZeRO / FSDP: parameters, gradients, optimizer.

Counted from the live tensors the engines keep (distinct storages, so views into DeepSpeed's flat
buffers count once), between optimizer steps:

- parameters: the module's parameters as this rank stores them: a ZeRO-3 partition (``ds_tensor``), an
  FSDP2 shard (the DTensor's local tensor) or the whole tensor;
- optimizer: what the (innermost) optimizer steps on and keeps: DeepSpeed's fp32 master partitions and
  every state tensor (Adam's moments), wherever they live (offloaded ones included: on the CPU they are
  the same RAM);
- gradients: ``.grad`` of those tensors and DeepSpeed's partitioned gradient buffers when alive.

torch is imported by the functions, not at module import.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator


def _storage_key(t: Any) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    ptr = st.data_ptr()
    return (ptr, st.nbytes()) if ptr else None


def _local(t: Any) -> Any:
    """The tensor this rank stores for ``t``: a ZeRO-3 partition, a DTensor's local shard, or ``t``."""
    if hasattr(t, "ds_tensor") and t.ds_tensor is not None:
        return t.ds_tensor
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def _tensors(obj: Any) -> Iterator[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def distinct_bytes(tensors: Iterable[Any], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``seen`` is shared to avoid double counts)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        key = _storage_key(_local(t))
        if key and key not in seen:
            seen.add(key)
            total += key[1]
    return total


def innermost_optimizer(optimizer: Any) -> Any:
    """accelerate's wrapper → DeepSpeed's ZeRO optimizer → the torch optimizer it steps."""
    chain = [optimizer]
    while hasattr(chain[-1], "optimizer") and chain[-1].optimizer is not chain[-1]:
        chain.append(chain[-1].optimizer)
    return chain


def rank_state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer", "total"} bytes this rank holds (see module doc)."""
    seen: set = set()
    params = list(model.parameters())
    out = {"parameters": distinct_bytes(params, seen)}
    chain = innermost_optimizer(optimizer) if optimizer is not None else []
    opt_tensors: list[Any] = []
    for opt in chain:
        for group in getattr(opt, "param_groups", []) or []:
            opt_tensors.extend(group.get("params", []))
        state = getattr(opt, "state", None)
        if isinstance(state, dict):
            opt_tensors.extend(_tensors(list(state.values())))
    out["optimizer"] = distinct_bytes(opt_tensors, seen)
    grads = [p.grad for p in params + opt_tensors if getattr(p, "grad", None) is not None]
    for opt in chain:  # DeepSpeed ZeRO keeps partitioned gradients in its own buffers
        for name in ("averaged_gradients", "fp32_partitioned_groups_flat_grad", "grad_partitions_flat_buffer"):
            grads.extend(_tensors(getattr(opt, name, None)))
    out["gradients"] = distinct_bytes(grads, seen)
    out["total"] = out["parameters"] + out["optimizer"] + out["gradients"]
    return out
