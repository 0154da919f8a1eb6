"""The context guard: how long a sequence may be for a model's position encoding (#36 item 4).

One rule, read by plan, estimate, train and the page (memfit.plan.rules' ``_context`` refuses; the CLI, plan's
"why" and train's notes show the note):

- **Learned absolute positions** (an embedding table of ``n_positions`` rows: transformers'
  ``GPTBigCodeModel.wpe = nn.Embedding(config.max_position_embeddings, ...)``, where GPTBigCodeConfig maps
  ``max_position_embeddings`` onto ``n_positions``; GPT-2 alike) have no row past the table: a longer sequence
  indexes past it (an IndexError on the CPU, a device-side assert on CUDA, at step 1). Refused in one line.
- **Rotary positions** (RoPE: Llama, Mistral, Qwen, Gemma, Granite, Mixtral, Qwen-MoE, Falcon, GPT-NeoX) are
  computed for any position (transformers' ``*RotaryEmbedding.forward`` takes the position ids), so a sequence
  past ``max_position_embeddings`` (the length the model was trained to) runs, meeting rotations it was not
  trained on; ``rope_scaling`` (transformers' ``ROPE_INIT_FUNCTIONS``: linear, dynamic, yarn, longrope, llama3)
  stretches them. Allowed, with a note naming the trained length and the config's ``rope_scaling`` (or its
  absence). Falcon with ``alibi: true`` (ALiBi biases, no position table) is allowed the same way.

The run file's ``rope_scaling`` (memfit.spec.run) replaces the config's: train loads the model with it
(:func:`rope_parameters`), plan and estimate name it in the note. Plain Python, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from memfit.errors import ConfigError

# model types whose positions are a learned table, and the config keys that size it (first present wins)
LEARNED = {"gpt_bigcode": ("n_positions", "max_position_embeddings"), "gpt2": ("n_positions",),
           "opt": ("max_position_embeddings",), "gptj": ()}
ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")  # transformers' ROPE_INIT_FUNCTIONS
_NOT_SCALING = ("rope_theta", "partial_rotary_factor")  # transformers 5 keeps them in rope_parameters too


@dataclass(frozen=True)
class Positions:
    """A model's position encoding: ``kind`` learned | rope | alibi; ``trained`` the table's rows (learned) or
    the trained length (``max_position_embeddings``); ``field`` the config key it came from; ``scaling`` the
    config's rope_scaling as JSON text ('' when it has none)."""

    kind: str
    trained: int
    field: str
    scaling: str = ""


def config_scaling(cfg: dict) -> Optional[dict]:
    """The config's RoPE scaling (``rope_scaling``, or transformers 5's ``rope_parameters`` less its theta);
    None when there is none (absent, or rope_type default)."""
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not isinstance(raw, dict):
        return None
    scaling = {k: v for k, v in raw.items() if k not in _NOT_SCALING}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return scaling if scaling and kind != "default" else None


def from_config(cfg: dict) -> Positions:
    """The position encoding a parsed config.json describes."""
    mt = cfg.get("model_type")
    if mt in LEARNED:
        for key in LEARNED[mt] or ("n_positions",):
            if isinstance(cfg.get(key), int):
                return Positions("learned", cfg[key], key)
    trained = cfg.get("max_position_embeddings")
    trained = trained if isinstance(trained, int) and not isinstance(trained, bool) else 2048
    if cfg.get("alibi"):
        return Positions("alibi", trained, "max_position_embeddings")
    scaling = config_scaling(cfg)
    return Positions("rope", trained, "max_position_embeddings",
                     json.dumps(scaling, sort_keys=True) if scaling else "")


@lru_cache(maxsize=64)
def _from_json(text: str) -> Positions:
    return from_config(json.loads(text))


def positions(model: Any) -> Positions:
    """A ModelSpec's position encoding (from the config.json it was read from; a spec built by hand: learned
    when it carries a position table, else RoPE)."""
    text = getattr(model, "config_json", "")
    if text:
        return _from_json(text)
    if getattr(model, "position_embeddings", 0):
        return Positions("learned", model.max_positions, "n_positions")
    return Positions("rope", model.max_positions, "max_position_embeddings")


def refusal(model: Any, seq_len: int) -> Optional[str]:
    """The one line refusing ``seq_len`` for ``model``; None when the length can run."""
    pos = positions(model)
    if pos.kind != "learned" or seq_len <= pos.trained:
        return None
    return (f"strategy.seq_len={seq_len} is above {model.name}'s {pos.field}={pos.trained}: its positions are a "
            f"learned table of {pos.trained} rows (nothing stretches them); use --seq-len {pos.trained} or less "
            f"(run file: strategy.seq_len)")


def _text(scaling: dict) -> str:
    return json.dumps(scaling, sort_keys=True, separators=(", ", ": "))


def note(model: Any, seq_len: int, rope_scaling: Optional[dict] = None) -> Optional[str]:
    """The note for ``seq_len`` past a RoPE / ALiBi model's trained length (None within it, or learned);
    ``rope_scaling``: the run file's, which replaces the config's."""
    pos = positions(model)
    if pos.kind == "learned" or seq_len <= pos.trained:
        return None
    head = (f"context: seq_len {seq_len} is past {model.name}'s trained length {pos.trained} "
            f"({pos.field}); ")
    if pos.kind == "alibi":
        return head + "ALiBi biases extend to any length (untrained past it): allowed"
    own = f"the config's rope_scaling {_text(json.loads(pos.scaling))}" if pos.scaling else \
        "no rope_scaling in the config"
    if rope_scaling:
        return head + f"RoPE, allowed; the run's rope_scaling {_text(rope_scaling)} replaces {own}"
    factor = -(-seq_len * 10 // pos.trained) / 10
    return (head + f"RoPE, allowed (the rotations past {pos.trained} are untrained); {own}; rope_scaling in the "
            f"run file (or --rope-scaling) stretches them, e.g. {{rope_type: yarn, factor: {factor:g}}}")


def check_rope_scaling(value: Any) -> Optional[dict]:
    """The run file's ``rope_scaling`` checked: a mapping with ``rope_type`` one of ROPE_TYPES (``type`` is
    read as its old name) and a positive ``factor`` (longrope: its short_factor / long_factor lists instead)."""
    if value is None:
        return None
    allowed = ", ".join(ROPE_TYPES)
    if not isinstance(value, dict):
        raise ValueError(f"must be a mapping such as {{rope_type: yarn, factor: 4.0}} (rope_type: {allowed})")
    value = dict(value)
    if "type" in value and "rope_type" not in value:
        value["rope_type"] = value.pop("type")
    kind = value.get("rope_type")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r}: one of {allowed}, e.g. {{rope_type: yarn, factor: 4.0}}")
    factor = value.get("factor")
    if kind != "longrope" and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
        raise ValueError(f"rope_type {kind} needs a positive factor, e.g. {{rope_type: {kind}, factor: 4.0}}")
    return value


def train_guard(cfg: dict, name: str, seq_len: int, rope_scaling: Optional[dict]) -> tuple[Optional[int], list[str]]:
    """For training from ``cfg`` (a config.json dict): (the learned table's rows, or None: no length limit;
    the notes to show). Raises the one-line refusal (a learned table too short, or rope_scaling for a model
    without RoPE)."""
    pos = from_config(cfg)
    spec = _Named(name, json.dumps(cfg, sort_keys=True))
    line = refusal(spec, seq_len)
    if line:
        raise ConfigError(line)
    return (pos.trained if pos.kind == "learned" else None), notes(spec, seq_len, rope_scaling)


def notes(model: Any, seq_len: int, rope_scaling: Optional[dict] = None) -> list[str]:
    """[the note] or [] for ``seq_len``; a ConfigError line when ``rope_scaling`` is given for a model without
    RoPE (nothing to scale)."""
    kind = positions(model).kind
    if rope_scaling and kind != "rope":
        raise ConfigError(f"rope_scaling: {model.name} has {kind} positions, no RoPE to scale; remove rope_scaling")
    text = note(model, seq_len, rope_scaling)
    return [text] if text else []


@dataclass(frozen=True)
class _Named:
    name: str
    config_json: str


def rope_parameters(cfg: dict, rope_scaling: dict) -> dict:
    """What train passes as ``rope_parameters`` to ``from_pretrained`` (transformers 5 names the config's RoPE
    settings so; its ``rope_scaling`` keyword drops the theta): the config's theta with the run's scaling."""
    base = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = base.get("rope_theta", cfg.get("rope_theta"))
    return {**({"rope_theta": theta} if theta is not None else {}), **rope_scaling}
