"""Adding MEFT to a model, and what a caller reads back: traffic, memory, save/load."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from memfit.errors import ConfigError, MemfitError
from memfit.meft.config import MeftConfig
from memfit.meft.layer import MeftAdapter, attach
from memfit.meft.transfer import Traffic

WEIGHTS_NAME = "meft_adapter.safetensors"
CONFIG_NAME = "meft_config.json"
FORMAT_VERSION = 1
_KEY_ROW_SOURCES = ("gate_proj", "up_proj", "w1", "fc1", "c_fc", "dense_h_to_4h")


class MeftContext:
    """What add_meft attaches to the model (as ``model._meft``): config, layers by name, traffic."""

    def __init__(self, config: MeftConfig, traffic: Traffic):
        self.config = config
        self.traffic = traffic
        self.layers: dict[str, MeftAdapter] = {}


def _hidden_size(model: nn.Module, ffn: nn.Module) -> int:
    if hasattr(ffn, "in_features"):
        return int(ffn.in_features)
    for name in _KEY_ROW_SOURCES:
        sub = getattr(ffn, name, None)
        if isinstance(sub, nn.Linear):
            return sub.in_features
        if sub is not None and hasattr(sub, "in_features"):
            return int(sub.in_features)
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    if size is None:
        raise ConfigError(f"meft: cannot tell the hidden size of {type(ffn).__name__}; "
                          "target a module with gate_proj/up_proj/fc1 or a model whose config has hidden_size")
    return int(size)


def _ffn_key_rows(ffn: nn.Module) -> Optional[torch.Tensor]:
    for name in _KEY_ROW_SOURCES:
        weight = getattr(getattr(ffn, name, None), "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point and weight.dim() == 2:
            if weight.device.type == "meta":
                return None
            return weight.detach()
    return None


def get_context(model: nn.Module) -> MeftContext:
    ctx = getattr(model, "_meft", None)
    if ctx is None:
        raise MemfitError("this model has no MEFT adapters: call memfit.meft.add_meft(model, config) first")
    return ctx


def adapters(model: nn.Module) -> dict[str, MeftAdapter]:
    return get_context(model).layers


def add_meft(model: nn.Module, config: MeftConfig) -> nn.Module:
    """Freeze the model and add a MEFT adapter beside every FFN whose name matches ``config.target``."""
    if getattr(model, "_meft", None) is not None:
        raise MemfitError("this model already has MEFT adapters; add_meft may be called once per model")
    pattern = re.compile(config.target)
    targets = [(name, mod) for name, mod in model.named_modules() if name and pattern.search(name)]
    if not targets:
        raise ConfigError(
            f"meft.target={config.target!r} matches no module of {type(model).__name__}; set it to a "
            "regex over module names such as r'layers\\.\\d+\\.mlp$'"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    pin = torch.cuda.is_available() if config.pin_memory is None else bool(config.pin_memory)
    ctx = MeftContext(config, Traffic())
    generator = torch.Generator().manual_seed(config.seed)
    for name, ffn in targets:
        hidden = _hidden_size(model, ffn)
        adapter = MeftAdapter(hidden, config, ctx.traffic, pin)
        rows = _ffn_key_rows(ffn) if config.init_keys_from_ffn else None
        adapter.init_weights(rows, generator)
        device = next((p.device for p in ffn.parameters()), torch.device("cpu"))
        adapter.to(device)
        attach(ffn, adapter)
        ctx.layers[name] = adapter
    model._meft = ctx
    if hasattr(model, "enable_input_require_grads"):
        try:  # so that reentrant gradient checkpointing sees inputs that require grad
            model.enable_input_require_grads()
        except (NotImplementedError, AttributeError):
            pass
    return model


def traffic(model: nn.Module, which: str = "last") -> dict:
    """Bytes moved host->device and device->host.

    ``which="last"``: the last completed optimizer step (all its micro-batches' forward and backward);
    before the first step, the bytes counted so far. ``"current"``: since the last step (or reset).
    ``"total"``: since add_meft. Also reports ``keys_scored`` and ``dropped`` pairs for last/current.
    """
    t = get_context(model).traffic
    if which == "total":
        return dict(t.total)
    if which == "current" or t.last is None:
        return dict(t.current)
    if which == "last":
        return dict(t.last)
    raise MemfitError(f"traffic(which={which!r}): allowed 'last', 'current', 'total'")


def reset_traffic(model: nn.Module) -> None:
    get_context(model).traffic.reset()


def meft_state(model: nn.Module) -> dict:
    """Memory accounting: CPU bytes of the store (+ staging) and device bytes of buffers and router."""
    ctx = get_context(model)
    cfg = ctx.config
    cpu = sum(a.store.nbytes() + (a.transfer.host_bytes() if a.transfer else 0) for a in ctx.layers.values())
    optim = sum(getattr(a, "_optimizer_bytes", 0) for a in ctx.layers.values())
    device = sum(a.device_bytes() for a in ctx.layers.values())
    stats = [a.last_stats for a in ctx.layers.values() if a.last_stats is not None]
    return {
        "layers": len(ctx.layers),
        "neurons": cfg.neurons,
        "top_k": cfg.top_k,
        "experts": cfg.num_experts,
        "n_probe": cfg.probes if cfg.uses_router else 0,
        "buffer_rows": cfg.buffer_rows,
        "trainable_parameters": sum(2 * a.store.neurons * a.hidden for a in ctx.layers.values())
        + sum(p.numel() for p in model.parameters() if p.requires_grad),
        "cpu_bytes": cpu + optim,
        "cpu_optimizer_bytes": optim,
        "device_bytes": device,
        "pinned": any(a.store.pin for a in ctx.layers.values()),
        "last_union": [s.union for s in stats],
        "last_keys_scored": sum(s.keys_scored for s in stats),
        "last_dropped": sum(s.dropped for s in stats),
    }


def _atomic_write(path: Path, write) -> None:
    from memfit.io import atomic_file

    with atomic_file(path) as tmp:
        write(tmp)


def _paths(path: Union[str, os.PathLike]) -> tuple[Path, Path]:
    """(weights, config) for a folder (meft_adapter.safetensors + meft_config.json inside) or for a
    file ending in .safetensors (config beside it: same name, .json)."""
    p = Path(path)
    if p.suffix == ".safetensors":
        return p, p.with_suffix(".json")
    return p / WEIGHTS_NAME, p / CONFIG_NAME


def save_meft(model: nn.Module, path: Union[str, os.PathLike]) -> Path:
    """Write the adapters as safetensors plus a JSON config, each atomically (temp name, then rename).

    ``path`` is a folder, or a file name ending in ``.safetensors``. The config is also stored in the
    safetensors metadata, so the weights file alone is enough for load_meft.
    """
    from safetensors.torch import save_file

    ctx = get_context(model)
    weights, cfg_path = _paths(path)
    weights.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, a in ctx.layers.items():
        if a.transfer is not None:
            a.transfer.flush()
        tensors[f"{name}.keys"] = a.store.keys.contiguous()
        tensors[f"{name}.values"] = a.store.values.contiguous()
        if a.router is not None:
            tensors[f"{name}.router"] = a.router.weight.detach().float().cpu().contiguous()
    meta = {"format": "memfit-meft", "version": FORMAT_VERSION, "config": ctx.config.to_dict(),
            "layers": list(ctx.layers), "hidden": {n: a.hidden for n, a in ctx.layers.items()}}
    text = json.dumps(meta, indent=2)
    _atomic_write(weights, lambda p: save_file(tensors, str(p), metadata={"format": "pt", "memfit_meft": text}))
    _atomic_write(cfg_path, lambda p: p.write_text(text))
    return weights


def read_meft_config(path: Union[str, os.PathLike]) -> MeftConfig:
    """The MeftConfig saved at ``path`` (folder or .safetensors file)."""
    weights, cfg_path = _paths(path)
    if cfg_path.is_file():
        meta = json.loads(cfg_path.read_text())
    elif weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as fh:
            text = (fh.metadata() or {}).get("memfit_meft")
        if text is None:
            raise MemfitError(f"{weights}: no MEFT config in its metadata and no {cfg_path.name} beside it")
        meta = json.loads(text)
    else:
        raise MemfitError(f"{cfg_path}: not found; point load_meft at a folder or .safetensors file "
                          "written by save_meft")
    if meta.get("format") != "memfit-meft":
        raise MemfitError(f"{cfg_path}: not a memfit MEFT config (format={meta.get('format')!r})")
    return MeftConfig.from_dict(meta["config"])


def load_meft(model: nn.Module, path: Union[str, os.PathLike]) -> nn.Module:
    """Restore adapters saved by save_meft; adds them first (with the saved config) if absent."""
    from safetensors.torch import load_file

    config = read_meft_config(path)
    if getattr(model, "_meft", None) is None:
        add_meft(model, config)
    ctx = get_context(model)
    weights, _ = _paths(path)
    if not weights.is_file():
        raise MemfitError(f"{weights}: not found; the folder holds a config but no adapter weights")
    tensors = load_file(str(weights))
    for name, a in ctx.layers.items():
        for part, dest in (("keys", a.store.keys), ("values", a.store.values)):
            key = f"{name}.{part}"
            if key not in tensors:
                raise MemfitError(f"{weights}: no tensor {key!r}; it was saved from a different model/target")
            if tensors[key].shape != dest.shape:
                raise MemfitError(f"{weights}: {key} has shape {tuple(tensors[key].shape)}, the model "
                                  f"expects {tuple(dest.shape)}; use the same neurons/model as when saved")
            dest.copy_(tensors[key])
        if a.router is not None:
            key = f"{name}.router"
            if key not in tensors or tensors[key].shape != a.router.weight.shape:
                raise MemfitError(f"{weights}: router {key!r} missing or of another shape; "
                                  "load into a model with the saved experts setting")
            with torch.no_grad():
                a.router.weight.copy_(tensors[key].to(a.router.weight.device))
        if a.transfer is not None:
            a.transfer.generation += 1  # buffers no longer mirror the store
    return model
