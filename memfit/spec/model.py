"""ModelSpec: the architecture numbers of a decoder LLM, read from a Hugging Face ``config.json``.

Plain Python (no torch, no transformers): a preset name, a model folder or a ``config.json`` path
becomes a frozen :class:`ModelSpec` with an exact parameter count and the list of per-layer linear
modules (the names PEFT's ``target_modules`` match), so LoRA trainable counts are exact too.

Supported ``model_type`` values: llama, mistral, qwen2, qwen3, gemma, gemma2 (Llama-style blocks:
RMSNorm, RoPE, gated MLP, grouped-query attention; qwen3 adds per-head q/k norms, gemma2 four norms per
layer), falcon (fused QKV, GeLU MLP, LayerNorm, multi-query / grouped KV heads,
parallel attention) and gpt_neox (fused QKV with biases, GeLU MLP, LayerNorm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional

from memfit.errors import ConfigError

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
FALCON_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")
SUPPORTED_TYPES = (*LLAMA_STYLE, "falcon", "gpt_neox")


@dataclass(frozen=True)
class Linear:
    """One linear module of a decoder layer: PEFT matches ``name`` against ``target_modules``."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def parameters(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only model; every count is exact for the supported families.

    ``biases`` names the per-layer linears that carry a bias (e.g. qwen2: q/k/v). ``linears`` lists one
    layer's linear modules; ``norms_per_layer`` counts its norm modules. ``parameters`` is the exact
    total (embeddings, all layers, final norm, and the output head unless tied).
    """

    name: str
    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    mlp: str  # "swiglu" | "geglu" (gated, 3 matrices) | "gelu" (2 matrices)
    norm: str  # "rmsnorm" | "layernorm"
    tie_embeddings: bool
    biases: tuple[str, ...]
    max_positions: int
    linears: tuple[Linear, ...]
    norms_per_layer: int = 2
    qk_norm: bool = False  # per-head RMSNorm on q and k (qwen3)
    parallel_attn: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    source: str = ""
    # derived (filled in __post_init__)
    parameters: int = field(default=0, compare=False)
    layer_parameters: int = field(default=0, compare=False)
    embedding_parameters: int = field(default=0, compare=False)
    _lora_cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        norm_params = self.hidden * (2 if self.norm == "layernorm" else 1)
        layer = sum(lin.parameters for lin in self.linears) + self.norms_per_layer * norm_params
        if self.qk_norm:
            layer += 2 * self.head_dim
        embed = self.vocab * self.hidden
        total = self.layers * layer + embed + norm_params + (0 if self.tie_embeddings else embed)
        object.__setattr__(self, "layer_parameters", layer)
        object.__setattr__(self, "embedding_parameters", embed)
        object.__setattr__(self, "parameters", total)

    # ---- derived sizes used by the estimator -------------------------------------------------
    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: kv_heads × head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def linear_layer_parameters(self) -> int:
        """Parameters of all decoder-layer linears (what NF4 quantises), over all layers."""
        return self.layers * sum(lin.parameters for lin in self.linears)

    @property
    def head_parameters(self) -> int:
        """Output-head parameters counted in ``parameters`` (0 when tied to the input embedding)."""
        return 0 if self.tie_embeddings else self.embedding_parameters

    @property
    def matmul_parameters(self) -> int:
        """Parameters that take part in matmuls per token (the embedding lookup is free; a tied head
        is used as a matmul once)."""
        return self.parameters - (0 if self.tie_embeddings else self.embedding_parameters)

    def linear_names(self) -> list[str]:
        return [lin.name for lin in self.linears]

    def lora_linears(self, targets: Iterable[str] | str) -> list[Linear]:
        """The per-layer linears PEFT would adapt for ``target_modules=targets``.

        ``"all-linear"`` (string or sole element) means every decoder-layer linear (PEFT excludes the
        output head). A target matches a linear whose name equals it or ends with ``.name``.
        """
        if isinstance(targets, str):
            targets = (targets,)
        targets = tuple(targets)
        if targets == ("all-linear",):
            return list(self.linears)
        wanted = {t.rsplit(".", 1)[-1] for t in targets}
        return [lin for lin in self.linears if lin.name in wanted]

    def lora_parameters(self, targets: Iterable[str] | str, r: int) -> int:
        """Exact LoRA trainable parameters: r × (in + out) per adapted linear, over all layers."""
        key = (tuple(targets) if not isinstance(targets, str) else (targets,), r)
        hit = self._lora_cache.get(key)
        if hit is None:
            hit = self.layers * sum(r * (lin.in_features + lin.out_features) for lin in self.lora_linears(key[0]))
            self._lora_cache[key] = hit
        return hit

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name, "family": self.family, "parameters": self.parameters,
            "hidden": self.hidden, "layers": self.layers, "heads": self.heads, "kv_heads": self.kv_heads,
            "head_dim": self.head_dim, "intermediate": self.intermediate, "vocab": self.vocab,
            "mlp": self.mlp, "norm": self.norm, "tie_embeddings": self.tie_embeddings,
            "max_positions": self.max_positions,
        }


# ---- config.json readers -----------------------------------------------------------------------

def _need(cfg: dict, key: str, where: str, *alts: str) -> int:
    for k in (key, *alts):
        value = cfg.get(k)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}: '{k}' must be a positive integer, got {value!r}")
            return value
    names = " or ".join(repr(k) for k in (key, *alts))
    raise ConfigError(f"{where}: missing {names}; a decoder config.json from Hugging Face has it")


def _llama_style(cfg: dict, name: str, where: str) -> ModelSpec:
    mt = cfg["model_type"]
    h = _need(cfg, "hidden_size", where)
    heads = _need(cfg, "num_attention_heads", where)
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    f = _need(cfg, "intermediate_size", where)
    attn_bias = bool(cfg.get("attention_bias", False)) or mt == "qwen2"
    mlp_bias = bool(cfg.get("mlp_bias", False))
    o_bias = bool(cfg.get("attention_bias", False))
    tie_default = mt in ("gemma", "gemma2")
    linears = (
        Linear("q_proj", h, heads * head_dim, attn_bias),
        Linear("k_proj", h, kv * head_dim, attn_bias),
        Linear("v_proj", h, kv * head_dim, attn_bias),
        Linear("o_proj", heads * head_dim, h, o_bias),
        Linear("gate_proj", h, f, mlp_bias),
        Linear("up_proj", h, f, mlp_bias),
        Linear("down_proj", f, h, mlp_bias),
    )
    return ModelSpec(
        name=name, family=mt, hidden=h, layers=_need(cfg, "num_hidden_layers", where), heads=heads,
        kv_heads=kv, head_dim=head_dim, intermediate=f, vocab=_need(cfg, "vocab_size", where),
        mlp="geglu" if mt in ("gemma", "gemma2") else "swiglu", norm="rmsnorm",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
        biases=tuple(lin.name for lin in linears if lin.bias),
        max_positions=int(cfg.get("max_position_embeddings") or 2048), linears=linears,
        norms_per_layer=4 if mt == "gemma2" else 2, qk_norm=mt == "qwen3", attention_dropout=float(cfg.get("attention_dropout") or 0.0), source=where,
    )


def _falcon(cfg: dict, name: str, where: str) -> ModelSpec:
    h = _need(cfg, "hidden_size", where, "n_embed")
    heads = _need(cfg, "num_attention_heads", where, "n_head")
    head_dim = h // heads
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    if new_arch:
        kv = cfg.get("num_kv_heads") or heads
    else:
        kv = 1 if cfg.get("multi_query", True) else heads
    f = cfg.get("ffn_hidden_size") or 4 * h
    bias = bool(cfg.get("bias", False))
    parallel = bool(cfg.get("parallel_attn", True))
    if new_arch:
        norms = cfg.get("num_ln_in_parallel_attn") or 2
    else:
        norms = 1 if parallel else 2
    linears = (
        Linear("query_key_value", h, (heads + 2 * kv) * head_dim, bias),
        Linear("dense", h, h, bias),
        Linear("dense_h_to_4h", h, f, bias),
        Linear("dense_4h_to_h", f, h, bias),
    )
    return ModelSpec(
        name=name, family="falcon", hidden=h, layers=_need(cfg, "num_hidden_layers", where, "n_layer"),
        heads=heads, kv_heads=kv, head_dim=head_dim, intermediate=f, vocab=_need(cfg, "vocab_size", where),
        mlp="gelu", norm="layernorm", tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        biases=tuple(lin.name for lin in linears if lin.bias),
        max_positions=int(cfg.get("max_position_embeddings") or 2048), linears=linears,
        norms_per_layer=int(norms), parallel_attn=parallel,
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        hidden_dropout=float(cfg.get("hidden_dropout") or 0.0), source=where,
    )


def _gpt_neox(cfg: dict, name: str, where: str) -> ModelSpec:
    h = _need(cfg, "hidden_size", where)
    heads = _need(cfg, "num_attention_heads", where)
    f = cfg.get("intermediate_size") or 4 * h
    bias = bool(cfg.get("attention_bias", True))
    linears = (
        Linear("query_key_value", h, 3 * h, bias),
        Linear("dense", h, h, bias),
        Linear("dense_h_to_4h", h, f, True),
        Linear("dense_4h_to_h", f, h, True),
    )
    return ModelSpec(
        name=name, family="gpt_neox", hidden=h, layers=_need(cfg, "num_hidden_layers", where), heads=heads,
        kv_heads=heads, head_dim=h // heads, intermediate=f, vocab=_need(cfg, "vocab_size", where),
        mlp="gelu", norm="layernorm", tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        biases=tuple(lin.name for lin in linears if lin.bias),
        max_positions=int(cfg.get("max_position_embeddings") or 2048), linears=linears, norms_per_layer=2,
        parallel_attn=bool(cfg.get("use_parallel_residual", True)),
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        hidden_dropout=float(cfg.get("hidden_dropout") or 0.0), source=where,
    )


def model_from_config(cfg: dict, name: str = "model", where: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a parsed config.json dict."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object with model_type, hidden_size, ...")
    try:
        return _model_from_config(cfg, name, where)
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: a field has a value of the wrong kind ({err}); compare it with the "
                          "model's original config.json") from None


def _model_from_config(cfg: dict, name: str, where: str) -> ModelSpec:
    mt = cfg.get("model_type")
    if mt in LLAMA_STYLE:
        return _llama_style(cfg, name, where)
    if mt in FALCON_TYPES:
        return _falcon(cfg, name, where)
    if mt == "gpt_neox":
        return _gpt_neox(cfg, name, where)
    raise ConfigError(
        f"{where}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_TYPES)} "
        "(decoder configs with those block structures)"
    )


def list_presets() -> list[str]:
    """Names of the shipped presets (config.json files, no weights)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def _read_json(path: Path) -> dict:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (not UTF-8); a config.json is JSON text written by "
                          "save_pretrained") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: malformed JSON at line {err.lineno} column {err.colno}: {err.msg}") from None


def read_config(path: Path) -> dict:
    """A config.json as a dict, or one ConfigError line (unreadable, not JSON, not an object)."""
    cfg = _read_json(Path(path))
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object with model_type, hidden_size, ..., got "
                          f"{type(cfg).__name__}")
    return cfg


@lru_cache(maxsize=64)
def _preset(key: str) -> ModelSpec:
    return model_from_config(_read_json(PRESET_DIR / f"{key}.json"), name=key, where=f"preset {key}")


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, a model folder (its config.json only: no weights, no torch) or a config.json path."""
    text = str(name_or_path).strip()
    if not text:
        raise ConfigError("model: empty name; give a preset (" + ", ".join(list_presets()) + "), a folder or a config.json")
    path = Path(text).expanduser()
    key = text.lower()
    preset = PRESET_DIR / f"{key}.json"
    if preset.is_file() and not path.exists():
        return _preset(key)
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"model folder {path} has no config.json; point --model at a Hugging Face model folder")
        return model_from_config(_read_json(cfg_path), name=path.resolve().name, where=str(cfg_path))
    if path.is_file():
        return model_from_config(_read_json(path), name=path.resolve().parent.name or path.stem, where=str(path))
    raise ConfigError(
        f"model {text!r}: not a preset, folder or config.json; presets: {', '.join(list_presets())}"
    )


def preset_config(name: str) -> dict:
    """The raw config.json dict of a preset (to build a tiny model or write a folder)."""
    if name not in list_presets():
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(list_presets())}")
    return _read_json(PRESET_DIR / f"{name}.json")


def lora_target_reason(model: ModelSpec, targets: Iterable[str] | str) -> Optional[str]:
    """None if ``targets`` adapt at least one linear of ``model``; else the one-line reason."""
    if model.lora_linears(targets):
        return None
    shown = targets if isinstance(targets, str) else ",".join(targets)
    return (f"lora_targets {shown} match no linear of {model.name} ({model.family}); "
            f"its linears: {','.join(model.linear_names())} (or 'all-linear')")
