"""Load the run's model (a local folder, or a Hub id ``owner/name[@revision]`` by id through transformers
and the HF cache) and apply the run's method (:mod:`memfit.methods`). Never ``trust_remote_code``: the
architectures memfit plans are all transformers' own.

The method's ``load_kwargs`` (QLoRA's 4-bit config) go to ``from_pretrained``; its ``build`` wraps the
loaded model (gradient checkpointing, always non-reentrant; peft; MEFT). The model is put in train mode
after wrapping (otherwise checkpointing silently does nothing).
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from memfit.errors import ConfigError
from memfit.methods import for_strategy
from memfit.methods.base import load_dtypes
from memfit.resolve import model_dir
from memfit.spec.model import HubId, hub_config_file


@dataclass
class ModelInfo:
    path: str
    method: str
    dtype: str
    attention: str
    device: str
    params: int = 0
    trainable: int = 0
    max_positions: Optional[int] = None
    lora_targets: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def choose_attention(requested: str, notes: list[str]) -> str:
    """The attn_implementation for transformers; FA2 only where flash_attn and an Ampere+ GPU exist."""
    if requested == "fa2":
        import torch

        reason = None
        if importlib.util.find_spec("flash_attn") is None:
            reason = "the flash_attn package is not installed"
        elif not torch.cuda.is_available():
            reason = "there is no CUDA GPU"
        elif torch.cuda.get_device_capability()[0] < 8:
            reason = f"{torch.cuda.get_device_name()} is older than Ampere (FA2 needs compute capability 8.0+)"
        if reason:
            notes.append(f"attention fa2 unavailable ({reason}); using sdpa instead, the planner's "
                         "fallback (set strategy.attention=sdpa to silence this)")
            return "sdpa"
        return "flash_attention_2"
    return requested


def _source(model) -> tuple[str, dict]:
    """(what from_pretrained loads, its keyword arguments): a local folder without any download, or a Hub
    id at its revision (huggingface_hub's cache and environment: HF_HOME, HF_HUB_OFFLINE, HF_TOKEN)."""
    if isinstance(model, HubId):
        return model.repo_id, ({"revision": model.revision} if model.revision else {})
    return str(model), {"local_files_only": True}


def load_tokenizer(path):
    """The tokenizer of a model folder (Path) or of a Hub id (:class:`HubId`)."""
    from transformers import AutoTokenizer

    name, kwargs = _source(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    except Exception as err:  # noqa: BLE001 - narrowed by _damaged
        if not _damaged(err):
            raise
        if isinstance(path, HubId):
            raise ConfigError(f"model: {path} has no usable tokenizer on the Hub or in the cache "
                              f"({_first_line(err)}); pass a local folder with one") from None
        raise ConfigError(f"model: {path} has no usable tokenizer or config ({_first_line(err)}); save "
                          "them with save_pretrained into the folder") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load(auto_cls, path, kwargs: dict):
    """from_pretrained; a damaged folder (config values of the wrong kind, corrupt or empty weights), or
    weights of a Hub id that cannot be fetched, is one ConfigError line."""
    name, where = _source(path)
    try:
        return auto_cls.from_pretrained(name, **where, **kwargs)
    except Exception as err:  # noqa: BLE001 - narrowed by _damaged
        if not _damaged(err):
            raise
        why = _first_line(err)
    if isinstance(path, HubId):
        raise ConfigError(f"model: {path} cannot be loaded from the Hub or its cache ({why}); check "
                          "HF_TOKEN and the network (HF_HUB_OFFLINE=1 needs the weights cached), or pass a "
                          "local folder") from None
    raise ConfigError(f"model: {path} cannot be loaded ({why}); check config.json and the *.safetensors "
                      "files (write them with save_pretrained)") from None


# errors of a damaged model folder: config values of the wrong kind (huggingface_hub's strict
# dataclasses), corrupt or empty safetensors, missing files. Out-of-memory and bugs are not among them.
_DAMAGED_NAMES = {"SafetensorError", "StrictDataclassError", "StrictDataclassFieldValidationError",
                  "StrictDataclassClassValidationError", "HeaderTooLarge", "HeaderTooSmall"}


def _damaged(err: BaseException) -> bool:
    import torch

    if isinstance(err, torch.OutOfMemoryError):
        return False
    return isinstance(err, (ValueError, TypeError, KeyError, OSError, AttributeError)) or \
        any(c.__name__ in _DAMAGED_NAMES for c in type(err).__mro__)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def build_model(run, local_rank: int = 0, engine=None, tokenizer: bool = True):
    """(model ready for Trainer, tokenizer or None, ModelInfo) for ``run`` (a RunSpec) under ``engine``
    (default: the run's engine from :mod:`memfit.distributed.engines`)."""
    from transformers import AutoModelForCausalLM

    from memfit.spec.context import rope_parameters, train_guard
    from memfit.spec.model import read_config

    from memfit.distributed.engines import for_run

    engine = engine or for_run(run)
    s = run.strategy
    path = model_dir(run.model)  # a folder, or a Hub id (config.json already fetched)
    notes: list[str] = []
    cfg_path = hub_config_file(path) if isinstance(path, HubId) else path / "config.json"
    cfg = read_config(cfg_path)
    max_pos = cfg.get("max_position_embeddings")
    if max_pos is not None and (not isinstance(max_pos, int) or isinstance(max_pos, bool)):
        raise ConfigError(f"{cfg_path}: max_position_embeddings must be an integer, got {max_pos!r}")
    # learned positions end at their table (one line); RoPE past its trained length runs, with a note
    max_pos, long = train_guard(cfg, getattr(path, "name", str(path)), s.seq_len, run.rope_scaling)
    notes += long
    tokenizer = load_tokenizer(path) if tokenizer else None
    method = for_strategy(s)
    load_dtype, compute_dtype = load_dtypes(s, cuda=_on_cuda())
    attention = choose_attention(s.attention, notes)
    kwargs: dict[str, Any] = dict(dtype=load_dtype, attn_implementation=attention)
    kwargs.update(method.load_kwargs(run, compute_dtype, engine, local_rank, _on_cuda(), notes))
    if run.rope_scaling:  # the run file's, as transformers 5 names it (its rope_scaling keyword drops the theta)
        kwargs["rope_parameters"] = rope_parameters(cfg, run.rope_scaling)
    model = _load(AutoModelForCausalLM, path, kwargs)
    model.config.use_cache = False
    if s.loss == "chunked" and not s.liger:  # on the transformers model itself, before PEFT / MEFT / engine wrapping
        # (liger: the Trainer applies Liger's fused linear cross-entropy: memfit.train.trainer)
        from memfit.train.loss import install_chunked_loss

        install_chunked_loss(model)
    model, targets = method.build(model, run, engine)
    model.train()  # after wrapping: otherwise checkpointing silently does nothing

    # ZeRO-3 loads parameters already partitioned: ds_numel is the full size
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    outside = method.parameters_outside(model)  # MEFT's keys/values live in a CPU store
    trainable = outside or sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    params += outside
    device = f"cuda:{local_rank}" if _on_cuda() else "cpu"
    info = ModelInfo(path=str(path), method=s.method, dtype=str(load_dtype).replace("torch.", ""),
                     attention=attention, device=device, params=params, trainable=trainable,
                     max_positions=max_pos, lora_targets=targets, notes=notes)
    return model, tokenizer, info
