"""ModelSpec: the architecture numbers of a decoder LLM, read from a Hugging Face ``config.json``.

Plain Python (no torch, no transformers): a preset name, a model folder, a ``config.json`` path or a
Hugging Face Hub id (``owner/name[@revision]``: its ``config.json`` only, through ``huggingface_hub``'s
cache, imported on that path alone) becomes a frozen :class:`ModelSpec` with an exact parameter count and the list
of per-layer linear modules (the names PEFT's ``target_modules`` match), so LoRA trainable counts are exact too.

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
import os
import re
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
    # the config.json it was read from, as JSON text (method=peft builds the model from it on the meta device)
    config_json: str = field(default="", compare=False, repr=False, hash=False)

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

        spec = spec_from_config(cfg, name, where)
        object.__setattr__(spec, "config_json", json.dumps(cfg, sort_keys=True))
        return spec
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
    """A preset name, a model folder (its config.json only: no weights, no torch), a config.json path, or
    a Hub id ``owner/name[@revision]`` that is not a local path (its config.json from the Hub cache)."""
    text = str(name_or_path).strip()
    if not text:
        raise ConfigError("model: empty name; give a preset (" + ", ".join(list_presets()) + "), a folder, "
                          "a config.json or a Hub id (owner/name)")
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
    hub = hub_id(text)
    if hub is not None:
        return model_from_config(read_config(hub_config_file(hub)), name=str(hub), where=f"{hub} config.json")
    raise ConfigError(
        f"model {text!r}: not a preset, folder or config.json, nor a Hub id (owner/name[@revision]); "
        f"presets: {', '.join(list_presets())}"
    )


# ---- Hugging Face Hub ids ------------------------------------------------------------------------
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class HubId:
    """A model repository on the Hugging Face Hub, ``owner/name``, at ``revision`` (a branch, tag or
    commit; None: the repository's default branch)."""

    repo_id: str
    revision: Optional[str] = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def hub_id(text: str) -> Optional[HubId]:
    """``text`` as a Hub id (``owner/name`` with an optional ``@revision``) when it has that shape and is
    not an existing local path; None otherwise (presets and local paths are resolved first)."""
    text = str(text).strip()
    if not text or Path(text).expanduser().exists():
        return None
    repo, at, revision = text.partition("@")
    if not _HUB_NAME.fullmatch(repo) or repo.endswith(".json") or (at and not revision.strip()):
        return None
    return HubId(repo, revision.strip() or None)


def _connection_errors() -> tuple[type, ...]:
    """The HTTP clients' connection/timeout errors (huggingface_hub uses httpx or requests by version)."""
    found: list[type] = []
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests.exceptions", ("ConnectionError", "Timeout"))):
        try:
            mod = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        found += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(found)


_hub_files: dict[tuple[str, Optional[str]], Path] = {}


def hub_config_file(hub: HubId) -> Path:
    """The local path of ``hub``'s config.json, downloaded (config.json only) by
    ``huggingface_hub.hf_hub_download`` into the standard HF cache: ``HF_HOME`` / ``HF_HUB_CACHE``,
    ``HF_ENDPOINT``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` act through huggingface_hub itself. Each failure
    (gated, no such repository or revision, no config.json, unreachable with nothing cached) is one
    ConfigError line saying what to do. Fetched once per process."""
    key = (hub.repo_id, hub.revision)
    if key in _hub_files:
        return _hub_files[key]
    try:
        import logging

        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                           HFValidationError, LocalEntryNotFoundError,
                                           RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:
        raise ConfigError(f"model {str(hub)!r}: a Hub id needs the huggingface_hub package (pip install "
                          "huggingface_hub), or pass a local folder") from None
    local = "or pass a local folder"
    offline = (f"model {str(hub)!r}: config.json is not in the cache and the Hub is unreachable "
               f"(HF_HUB_OFFLINE=1?): download it first (hf download {hub.repo_id} config.json), {local}")
    gated = f"model {str(hub)!r} is gated: accept its licence on the Hub and set HF_TOKEN, {local}"
    missing = (f"model {str(hub)!r}: not a local path, and no such model repository on the Hub (a private "
               f"one needs HF_TOKEN); check the id, {local}")
    hf_logger = logging.getLogger("huggingface_hub")
    level = hf_logger.level
    if not os.environ.get("HF_HUB_VERBOSITY"):  # its retry warnings would bury the one-line answer
        hf_logger.setLevel(logging.ERROR)
    try:
        path = Path(hf_hub_download(hub.repo_id, "config.json", revision=hub.revision))
    except GatedRepoError:
        raise ConfigError(gated) from None
    except RevisionNotFoundError:
        raise ConfigError(f"model {str(hub)!r}: the Hub repository {hub.repo_id} has no revision "
                          f"{hub.revision!r}; give an existing branch, tag or commit after '@', {local}") from None
    except RepositoryNotFoundError:
        raise ConfigError(missing) from None
    except LocalEntryNotFoundError:
        raise ConfigError(offline) from None
    except EntryNotFoundError:
        raise ConfigError(f"model {str(hub)!r}: the Hub repository has no config.json (not a transformers "
                          "model?); pass a local folder with one instead") from None
    except HfHubHTTPError as err:
        code = getattr(getattr(err, "response", None), "status_code", None)
        if code in (401, 403):
            raise ConfigError(gated) from None
        if code == 404:
            raise ConfigError(missing) from None
        raise ConfigError(f"model {str(hub)!r}: the Hub answered HTTP {code} for config.json; try again "
                          f"later, {local}") from None
    except HFValidationError as err:
        why = (str(err).strip().splitlines() or ["invalid"])[0]
        raise ConfigError(f"model {str(hub)!r}: not a valid Hub id ({why}); {local}") from None
    except PermissionError as err:
        raise ConfigError(f"model {str(hub)!r}: cannot write the Hugging Face cache ({err.strerror}: "
                          f"{err.filename}); set HF_HOME to a writable folder") from None
    except (OSError, *_connection_errors()):
        raise ConfigError(offline) from None
    finally:
        hf_logger.setLevel(level)
    _hub_files[key] = path
    return path


def config_file(name_or_path: str) -> Path:
    """The config.json behind ``name_or_path``: a preset's, a folder's, the file itself, or a Hub id's
    (downloaded as :func:`hub_config_file` does). A ConfigError line when there is none."""
    text = str(name_or_path).strip()
    path = Path(text).expanduser()
    preset = PRESET_DIR / f"{text.lower()}.json"
    if text and preset.is_file() and not path.exists():
        return preset
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model folder {path} has no config.json; point --model at a Hugging Face model folder")
        return path / "config.json"
    if path.is_file():
        return path
    hub = hub_id(text)
    if hub is not None:
        return hub_config_file(hub)
    raise ConfigError(f"model {text!r}: not a preset, folder or config.json, nor a Hub id (owner/name)")


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
