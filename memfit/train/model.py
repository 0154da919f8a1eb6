"""Load the run's model from a local folder and apply the method: full, LoRA, QLoRA (NF4) or MEFT.

Gradient checkpointing is always non-reentrant, so LoRA + checkpointing never hits the
"element 0 of tensors does not require grad" trap; the model is put in train mode after peft wrapping
(otherwise checkpointing silently does nothing).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from memfit.errors import ConfigError, IncompatibleError

GC_KWARGS = {"use_reentrant": False}
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


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


def resolve_model_dir(name: str) -> Path:
    """A local model folder with weights; anything else is a clear ConfigError."""
    p = Path(name).expanduser()
    if p.is_file() and p.name == "config.json":
        p = p.parent
    if not p.is_dir():
        if p.is_file():
            hint = "it is a file, not a folder"
        elif os.sep not in name and not p.suffix:
            hint = ("it looks like a preset name: presets hold architecture numbers only (for planning), "
                    "no weights")
        else:
            hint = "no such folder"
        raise ConfigError(f"model: '{name}' is not a local model folder ({hint}); memfit train needs a "
                          "folder with config.json and weights (*.safetensors), e.g. one written by "
                          "save_pretrained, or run `memfit demo` for the embedded tiny model")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model: {p} has no config.json; give a Hugging Face model folder")
    if not any(next(p.glob(g), None) for g in _WEIGHT_GLOBS):
        raise ConfigError(f"model: {p} has a config.json but no weights (*.safetensors); memfit train "
                          "cannot start from a config alone (use `memfit plan` for planning only)")
    return p


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


def _dtypes(run) -> tuple[Any, Any]:
    """(load dtype of the frozen/base weights, compute dtype) for the run's precision."""
    import torch

    p, method = run.strategy.precision, run.strategy.method
    if p == "fp16-mixed" and not _on_cuda():
        raise IncompatibleError("strategy.precision=fp16-mixed needs a CUDA GPU; on CPU use fp32 "
                                "(or bf16-mixed)")
    half = {"bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "fp16-mixed": torch.float16}.get(p)
    if half is None:
        return torch.float32, torch.float32
    if p == "bf16":
        return torch.bfloat16, torch.bfloat16
    # mixed precision: full FT keeps fp32 master weights; adapter methods keep the frozen base in half
    return (torch.float32 if method == "full" else half), half


def _quantization_config(run, compute_dtype, notes: list[str]):
    from transformers import BitsAndBytesConfig
    import torch

    if importlib.util.find_spec("bitsandbytes") is None:
        raise IncompatibleError("strategy.method=qlora needs bitsandbytes (pip install bitsandbytes) or "
                                "use method=lora")
    storage = {"uint8": torch.uint8, "bf16": torch.bfloat16, "fp16": torch.float16,
               "fp32": torch.float32}[run.strategy.quant_storage]
    if not _on_cuda():
        notes.append("qlora on CPU: bitsandbytes NF4 CPU kernels (slow, for testing the path)")
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=run.strategy.double_quant,
        bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=storage,
    )


def linear_module_names(model) -> set[str]:
    import torch

    names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or type(mod).__name__.startswith("Linear4bit"):
            names.add(name.rsplit(".", 1)[-1])
    names.discard("lm_head")
    return names


def lora_target_modules(model, targets: tuple[str, ...]) -> list[str] | str:
    """The run's LoRA targets that exist in this model; 'all-linear' passes through."""
    if "all-linear" in targets:
        return "all-linear"
    present = linear_module_names(model)
    chosen = [t for t in targets if t in present]
    if not chosen:
        raise ConfigError(f"strategy.lora_targets {list(targets)}: none is a linear layer of this model; "
                          f"it has {sorted(present)} (or use lora.targets=[all-linear])")
    return chosen


def _enable_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=GC_KWARGS)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=GC_KWARGS)


def meft_api():
    """memfit.meft's public functions, or a clear error while the package is not there yet."""
    try:
        import memfit.meft as meft
    except ImportError:
        meft = None
    names = ("MeftConfig", "add_meft", "build_meft_optimizer", "save_meft", "traffic")
    if meft is None or not all(hasattr(meft, n) for n in names):
        raise IncompatibleError("strategy.method=meft is not available yet in this memfit (memfit.meft "
                                "does not export add_meft); use method=lora")
    return meft


def meft_config(run):
    meft = meft_api()
    s = run.strategy
    return meft.MeftConfig(neurons=s.meft_neurons, top_k=s.meft_top_k, experts=s.meft_experts,
                           n_probe=s.meft_n_probe)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - narrowed by _damaged
        if not _damaged(err):
            raise
        raise ConfigError(f"model: {path} has no usable tokenizer or config ({_first_line(err)}); save "
                          "them with save_pretrained into the folder") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load(auto_cls, path: Path, kwargs: dict):
    """from_pretrained; a damaged folder (config values of the wrong kind, corrupt or empty weights) is
    one ConfigError line."""
    try:
        return auto_cls.from_pretrained(str(path), **kwargs)
    except Exception as err:  # noqa: BLE001 - narrowed by _damaged
        if not _damaged(err):
            raise
        why = _first_line(err)
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


def build_model(run, local_rank: int = 0, tokenizer: bool = True):
    """(model ready for Trainer, tokenizer or None, ModelInfo) for ``run`` (a RunSpec)."""
    import torch
    from transformers import AutoModelForCausalLM

    s = run.strategy
    path = resolve_model_dir(run.model)
    notes: list[str] = []
    from memfit.spec.model import read_config

    cfg = read_config(path / "config.json")
    max_pos = cfg.get("max_position_embeddings")
    if max_pos is not None and (not isinstance(max_pos, int) or isinstance(max_pos, bool)):
        raise ConfigError(f"{path / 'config.json'}: max_position_embeddings must be an integer, got {max_pos!r}")
    if max_pos and s.seq_len > max_pos:
        raise ConfigError(f"strategy.seq_len={s.seq_len} is above the model's max_position_embeddings="
                          f"{max_pos}; use --set strategy.seq_len={max_pos} or less")
    tokenizer = load_tokenizer(path) if tokenizer else None
    load_dtype, compute_dtype = _dtypes(run)
    attention = choose_attention(s.attention, notes)
    kwargs: dict[str, Any] = dict(dtype=load_dtype, attn_implementation=attention, local_files_only=True)
    if s.method == "qlora":
        kwargs["quantization_config"] = _quantization_config(run, compute_dtype, notes)
        if _on_cuda() and not (run.strategy.fsdp or run.strategy.zero_stage == 3):
            # FSDP / ZeRO-3 place the shards themselves (rank-0 loading / zero.Init); no device_map
            kwargs["device_map"] = {"": local_rank}
    model = _load(AutoModelForCausalLM, path, kwargs)
    model.config.use_cache = False

    targets: list[str] = []
    if s.method == "full":
        if s.gradient_checkpointing:
            _enable_checkpointing(model)
    elif s.method in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        from memfit.distributed.engine import enable_input_grads, skip_kbit_preparation

        if skip_kbit_preparation(run):  # ZeRO-3 / FSDP: no fp32 upcasts, uniform dtype to flatten
            enable_input_grads(model, s.gradient_checkpointing, GC_KWARGS)
        elif s.method == "qlora":
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=s.gradient_checkpointing,
                gradient_checkpointing_kwargs=GC_KWARGS,
            )
        elif s.gradient_checkpointing:
            _enable_checkpointing(model)
        tm = lora_target_modules(model, s.lora_targets)
        targets = [tm] if isinstance(tm, str) else tm
        lcfg = LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout,
                          target_modules=tm, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, lcfg)
    elif s.method == "meft":
        meft = meft_api()
        for p in model.parameters():
            p.requires_grad_(False)
        if s.gradient_checkpointing:
            _enable_checkpointing(model)
        model = meft.add_meft(model, meft_config(run)) or model
    model.train()  # after wrapping: otherwise checkpointing silently does nothing

    # ZeRO-3 loads parameters already partitioned: ds_numel is the full size
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    if s.method == "meft" and hasattr(meft_api(), "meft_state"):
        # MEFT's keys/values live in a CPU store, not in nn.Parameters
        trainable = int(meft_api().meft_state(model).get("trainable_parameters", trainable))
        params += trainable
    device = f"cuda:{local_rank}" if _on_cuda() else "cpu"
    info = ModelInfo(path=str(path), method=s.method, dtype=str(load_dtype).replace("torch.", ""),
                     attention=attention, device=device, params=params, trainable=trainable,
                     max_positions=max_pos, lora_targets=targets, notes=notes)
    return model, tokenizer, info
