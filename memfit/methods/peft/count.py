"""The adapter as PEFT builds it, counted on a meta-device copy of the model (torch, transformers and peft
imported here, inside functions; nothing is allocated): trainable parameters exactly as
``PeftModel.get_nb_trainable_parameters`` counts them, and which modules PEFT wrapped, by layer type.

Only ``method=peft`` asks for this, and only when a ``peft_config`` is given: the plain planner never
imports torch. Each count is cached in memory and read from disk (``$MEMFIT_CACHE/peft-counts/<key>.json``),
keyed by the model's config.json, the PEFT config and the installed peft / transformers versions, so a second
``memfit plan`` reads a small JSON file. Pricing never writes: new counts wait in memory until the caller (the
CLI, once a command has finished) calls :func:`save_counts`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

VERSION = 6  # bump when the counted fields change (old cache files are then ignored)
_MEMO: dict[str, dict] = {}
_UNSAVED: dict[str, dict] = {}  # counted in this process, not yet on disk


def cache_dir() -> Path:
    root = os.environ.get("MEMFIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "memfit")
    return Path(root) / "peft-counts"


@lru_cache(maxsize=1)
def _versions() -> str:
    """The installed peft / transformers versions (package metadata: no import), part of the cache key."""
    from importlib import metadata

    out = []
    for name in ("peft", "transformers"):
        try:
            out.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name}=none")
    return ",".join(out)


def cache_key(model_config: str, peft_config: str) -> str:
    text = f"{VERSION}\n{_versions()}\n{model_config}\n{peft_config}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def counted(model_config: str, peft_config: str) -> dict:
    """The count for a model (its config.json as JSON text) and a PEFT config (JSON text): from memory,
    the disk cache, or PEFT on the meta device (then saved)."""
    key = cache_key(model_config, peft_config)
    hit = _MEMO.get(key)
    if hit is not None:
        return hit
    path = cache_dir() / f"{key}.json"
    try:
        hit = json.loads(path.read_text())
    except (OSError, ValueError):
        hit = None
    if not isinstance(hit, dict) or hit.get("version") != VERSION:
        hit = count(json.loads(model_config), json.loads(peft_config))
        _UNSAVED[key] = hit
    _MEMO[key] = hit
    return hit


def save_counts() -> int:
    """Write the counts made in this process to the disk cache (how many); a read-only cache only costs the
    next process a recount."""
    from memfit.io import write_text

    saved = 0
    for key, hit in list(_UNSAVED.items()):
        try:
            write_text(cache_dir() / f"{key}.json", json.dumps(hit, sort_keys=True), "PEFT count cache")
            saved += 1
        except Exception:  # noqa: BLE001
            pass
        _UNSAVED.pop(key, None)
    return saved


def _imports():
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"strategy.method=peft counts the adapter with PEFT itself and needs torch, "
                          f"transformers and peft ({err.name} is missing): pip install 'memfit[train]'") from None


def peft_config_object(config: dict) -> Any:
    """``peft.PeftConfig`` from a dict as adapter_config.json holds it; a ConfigError line when PEFT refuses it."""
    _imports()
    from peft import PeftConfig
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    data = dict(config)
    kind = str(data.get("peft_type", "")).upper()
    cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(kind)
    if cls is None:
        raise ConfigError(f"peft_config.peft_type {data.get('peft_type')!r}: not a PEFT method; allowed: "
                          + ", ".join(sorted(PEFT_TYPE_TO_CONFIG_MAPPING)) + " (set peft_type to one of them)")
    data["peft_type"] = kind
    data.setdefault("task_type", "CAUSAL_LM")
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"peft_config.{unknown[0]}: not a field of peft {cls.__name__}; remove it (fields: "
                          + ", ".join(sorted(k for k in known if not k.startswith("_"))[:12]) + ", ...)")
    try:
        return PeftConfig.from_peft_type(**data) if hasattr(PeftConfig, "from_peft_type") else cls(**data)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"peft_config ({kind}): {str(err).splitlines()[0]}; fix that field") from None


def _plain(value: Any) -> Any:
    """JSON-able copy of a PeftConfig dict (sets as sorted lists, enums as their values)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(getattr(value, "value", value))


def _layer_type(module: Any) -> str:
    """'ia3.Linear' for peft.tuners.ia3.layer.Linear (the tuner's folder and the class)."""
    mod = type(module).__module__.split(".")
    tuner = mod[2] if len(mod) > 2 and mod[1] == "tuners" else mod[-1]
    return f"{tuner}.{type(module).__name__}"


def _hf_config(model_config: dict, **changes: Any) -> Any:
    from transformers import AutoConfig

    mcfg = {**model_config, **changes}
    kind = mcfg.pop("model_type", None)
    try:
        return AutoConfig.for_model(kind, **mcfg)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"model config: transformers cannot read model_type {kind!r} ({err})") from None


def _no_init() -> Any:
    try:
        from transformers.initialization import no_init_weights  # transformers 5

        return no_init_weights()
    except ImportError:  # another transformers: initialise (slower, same counts)
        import contextlib

        return contextlib.nullcontext()


def _build(hf: Any, peft_config: dict, device: str) -> tuple[Any, set, Any]:
    """(the PEFT model, ids of the base's own tensors, the PeftConfig) built on ``device``."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = peft_config_object(peft_config)
    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' and PEFT's notes about the model they build here
        with _no_init():  # the base's values are never read: not initialised (PEFT's own init runs)
            base = AutoModelForCausalLM.from_config(hf)
        before = {id(t) for t in (*base.parameters(), *base.buffers())}
        return get_peft_model(base, cfg), before, cfg


def count(model_config: dict, peft_config: dict) -> dict:
    """Build the model on the meta device, wrap it with PEFT, and count (see the module docstring). A method
    whose initialisation needs real values (BOFT's .item(), SHiRA's nonzero, FRoD's decomposition, UniLoRA's
    bincount) is built on the CPU with one and with two decoder layers (a small vocabulary unless the
    embeddings are adapted) and its counts extrapolated to the model's layers: each is linear in them."""
    _imports()
    try:
        model, before, cfg = _build(_hf_config(model_config), peft_config, "meta")
    except ConfigError:
        raise
    except (TypeError, ValueError, RuntimeError, NotImplementedError, AttributeError) as err:
        if "meta" not in str(err).lower():
            raise ConfigError(f"peft_config ({peft_config.get('peft_type')}): PEFT cannot build it on this model: "
                              f"{str(err).splitlines()[0]}") from None
        return _extrapolated(model_config, peft_config)
    return _tally(model, before, cfg)


def _extrapolated(model_config: dict, peft_config: dict) -> dict:
    layers = int(model_config.get("num_hidden_layers") or 1)
    text = json.dumps(peft_config).lower()
    small = {} if ("embed" in text or "lm_head" in text or "wte" in text) else {"vocab_size": 256}
    counts = []
    for n in (1, 2):
        try:
            model, before, cfg = _build(_hf_config(model_config, num_hidden_layers=n, **small), peft_config, "cpu")
        except ConfigError:
            raise
        except (TypeError, ValueError, RuntimeError, NotImplementedError, AttributeError) as err:
            raise ConfigError(f"peft_config ({peft_config.get('peft_type')}): PEFT cannot build it on this "
                              f"model: {str(err).splitlines()[0]}") from None
        counts.append(_tally(model, before, cfg))
        del model
    one, two = counts

    def grow(a: float, b: float) -> int:
        return int(a + (b - a) * (layers - 1))

    out = {**two, "extrapolated": True}
    for key in ("trainable", "outside", "frozen_added"):
        out[key] = grow(one[key], two[key])
    out["all"] = out["trainable"] + (two["all"] - two["trainable"])  # not used by the estimator
    first = {(w["type"], w["module"]): w for w in one["wrapped"]}
    out["wrapped"] = [{**w, "count": grow(first[k]["count"], w["count"]),
                       "params": grow(first[k]["params"], w["params"])}
                      for w in two["wrapped"] for k in [(w["type"], w["module"])] if k in first]
    return out


def _tally(model: Any, before: set, cfg: Any) -> dict:
    """The counts of a built PEFT model (see the module docstring)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    trainable, total = model.get_nb_trainable_parameters()
    # what the adapter adds beyond its trained parameters: frozen parameters and floating buffers (VeRA's
    # projections, OSF's SVD factors of the base weights), as elements (on the meta device every float is
    # the default dtype: the estimator prices them in the base's dtype)
    added = {id(t): t for t in (*model.parameters(), *model.buffers())
             if id(t) not in before and not t.requires_grad and t.is_floating_point()}
    frozen_added = sum(t.numel() for t in added.values())
    wrapped: dict[str, dict] = {}
    inside, seen = 0, set()
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        own = 0  # a parameter shared by several layers (VeRA's, VB-LoRA's banks) counts once, where first met
        for n, p in module.named_parameters():
            if p.requires_grad and "base_layer" not in n and id(p) not in seen:
                seen.add(id(p))
                own += p.numel()
        inside += own
        base_layer = module.get_base_layer()
        leaf = name.rsplit(".", 1)[-1]
        key = f"{_layer_type(module)}:{leaf}"
        entry = wrapped.setdefault(key, {"type": _layer_type(module), "module": leaf, "count": 0, "params": 0,
                                         "in": int(getattr(base_layer, "in_features", 0) or 0),
                                         "out": int(getattr(base_layer, "out_features", 0) or 0),
                                         "base": type(base_layer).__name__,
                                         "ff": bool(getattr(module, "is_feedforward", False))})
        entry["count"] += 1
        entry["params"] += own
    kind = cfg.peft_type.value if hasattr(cfg.peft_type, "value") else cfg.peft_type
    return {"version": VERSION, "peft_type": str(kind),
            "trainable": int(trainable), "all": int(total), "outside": int(trainable - inside),
            "frozen_added": int(frozen_added),
            "wrapped": [wrapped[k] for k in sorted(wrapped)],
            "config": _plain(cfg.to_dict()),  # PEFT's config with its own defaults filled in (r, init_r, ...)
            "virtual_tokens": int(getattr(cfg, "num_virtual_tokens", 0) or 0)
            if getattr(cfg, "is_prompt_learning", False) else 0}
