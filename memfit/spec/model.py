"""ModelSpec: the architecture numbers of a decoder LLM, read from a Hugging Face ``config.json``.

Plain Python (no torch, no transformers): a preset name, a model folder or a ``config.json`` path
becomes a frozen :class:`ModelSpec` with an exact parameter count and the list of per-layer linear
modules (the names PEFT's ``target_modules`` match), so LoRA trainable counts are exact too.

Supported ``model_type`` values: llama, mistral, qwen2, qwen3, gemma, gemma2, granite (Llama-style blocks:
RMSNorm, RoPE, gated MLP, grouped-query attention; qwen3 adds per-head q/k norms, gemma2 four norms per
layer; granite's multipliers are scalars), mixtral and qwen2_moe (Llama-style attention, a routed
mixture of gated experts: every expert's weights are held, each token passes through top-k of them;
qwen2_moe adds a gated shared expert), falcon (fused QKV, GeLU MLP, LayerNorm, multi-query / grouped KV
heads, parallel attention), gpt_neox (fused QKV with biases, GeLU MLP, LayerNorm) and gpt_bigcode
(multi-query fused QKV, learned positions, GeLU MLP, LayerNorm, biases).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional

from memfit.errors import ConfigError
from memfit.methods.base import matched_linears

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite")
MOE_TYPES = ("mixtral", "qwen2_moe")
FALCON_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")
SUPPORTED_TYPES = (*LLAMA_STYLE, *MOE_TYPES, "falcon", "gpt_neox", "gpt_bigcode")


@dataclass(frozen=True)
class Linear:
    """One linear module of a decoder layer: PEFT matches ``name`` (its last dotted part) against
    ``target_modules``. ``count`` copies of it per layer (a mixture's experts), each reached by the fraction
    ``active`` of the tokens (top-k / experts; 1 for a dense linear)."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False
    count: int = 1
    active: float = 1.0

    @property
    def parameters(self) -> int:
        return self.count * (self.in_features * self.out_features + (self.out_features if self.bias else 0))

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]


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
    experts: int = 0  # routed experts per layer (0: a dense MLP); ``intermediate`` is then the MLP width a
    experts_per_token: int = 0  # token passes through: top-k x expert width (+ the shared expert's)
    moe_intermediate: int = 0  # one routed expert's width
    position_embeddings: int = 0  # learned absolute positions (gpt_bigcode's wpe): parameters
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
        total = (self.layers * layer + embed + norm_params + (0 if self.tie_embeddings else embed)
                 + self.position_embeddings)
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
        return list(dict.fromkeys(lin.short for lin in self.linears))

    def lora_linears(self, targets: Iterable[str] | str) -> list[Linear]:
        """The per-layer linears PEFT would adapt for ``target_modules=targets``.

        Matched by :func:`memfit.methods.base.matched_linears` (``"all-linear"``: every decoder-layer
        linear; PEFT excludes the output head).
        """
        chosen = set(matched_linears(self.linear_names(), targets))
        return [lin for lin in self.linears if lin.short in chosen]

    def lora_parameters(self, targets: Iterable[str] | str, r: int) -> int:
        """Exact LoRA trainable parameters: r × (in + out) per adapted linear, over all layers."""
        key = (tuple(targets) if not isinstance(targets, str) else (targets,), r)
        hit = self._lora_cache.get(key)
        if hit is None:
            hit = self.layers * sum(lin.count * r * (lin.in_features + lin.out_features)
                                    for lin in self.lora_linears(key[0]))
            self._lora_cache[key] = hit
        return hit

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name, "family": self.family, "parameters": self.parameters,
            "hidden": self.hidden, "layers": self.layers, "heads": self.heads, "kv_heads": self.kv_heads,
            "head_dim": self.head_dim, "intermediate": self.intermediate, "vocab": self.vocab,
            "mlp": self.mlp, "norm": self.norm, "tie_embeddings": self.tie_embeddings,
            "max_positions": self.max_positions,
            **({"experts": self.experts, "experts_per_token": self.experts_per_token} if self.experts else {}),
        }


def model_from_config(cfg: dict, name: str = "model", where: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a parsed config.json dict."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object with model_type, hidden_size, ...")
    try:
        from memfit.spec.architectures import spec_from_config  # the readers build ModelSpecs

        return spec_from_config(cfg, name, where)
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: a field has a value of the wrong kind ({err}); compare it with the "
                          "model's original config.json") from None


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
