"""The page's inputs: what the user picked -> the model reference, the pool, the planner's arguments and
the equivalent ``memfit plan`` command line.

Each value is read the way ``memfit plan`` reads its flag (memfit.spec.model.resolve_model,
memfit.spec.hardware.parse_hardware), so the page and the command plan the same thing. A mistake raises
:class:`memfit.errors.ConfigError` with one line naming the field and the fix.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from memfit.errors import ConfigError
from memfit.methods import NAMES as ALL_METHODS, PLANNED

SOURCES = ("preset", "folder", "config.json")
CHOICE = "planner's choice"
OFFLOADS = (CHOICE, "none", "checkpointed", "all")
TILED = (CHOICE, "off", "on")
DEFAULT_MARGIN = 0.05


@dataclass
class Form:
    """One state of the page's inputs (the names of the controls)."""

    source: str = "preset"               # preset | folder | config.json
    preset: str = "llama-2-7b"
    folder: str = ""
    config_text: str = ""                # a pasted config.json
    config_file: Optional[str] = None    # an uploaded config.json (a path on the server)
    gpu: str = "RTX4090-24GB"
    count: Any = 1                       # GPUs per node
    nodes: Any = 1
    custom_gb: Any = None                # memory per GPU in GB (decimal), instead of the catalog's
    cpu_ram_gb: Any = None               # CPU RAM per node in GB (decimal); None: the catalog default
    seq_len: Any = 512
    micro_batch: Any = 1
    grad_accum: Any = 1
    methods: list = field(default_factory=lambda: list(PLANNED))
    margin: Any = DEFAULT_MARGIN
    # the long-context levers (memfit.spec.strategy): CHOICE / 0 leaves them to the planner, as `memfit plan` does
    sequence_parallel: Any = 0           # Ulysses degree (--sequence-parallel N; 1: off)
    context_parallel: Any = 0            # torch context parallelism (--context-parallel N; 1: off)
    activation_offload: str = CHOICE     # none | checkpointed | all (--activation-offload)
    tiled_mlp: str = CHOICE              # off | on (--no-tiled-mlp / --tiled-mlp)
    liger: str = "off"                   # off | on (--liger): Liger Kernel, not searched by the planner


def whole(value: Any, name: str, low: int = 1) -> int:
    """A positive whole number from a number box (which may hold None or a float)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: give a whole number of at least {low}") from None
    if number != int(number) or number < low:
        raise ConfigError(f"{name} {number:g}: must be a whole number of at least {low}")
    return int(number)


def gb_text(value: Any, name: str) -> Optional[str]:
    """'128GB' for a size in GB (what --cpu-ram takes); None when empty or 0 (a number box's blank)."""
    if value in (None, "") or value == 0:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: give a size in GB, e.g. 128") from None
    if number <= 0:
        raise ConfigError(f"{name} {number:g}: must be more than 0 GB")
    return f"{number:g}GB"


def _save_config(text: str, workdir: Path) -> str:
    """A pasted config.json, checked and kept as ``workdir/config-<hash>/config.json``; its path."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"config.json: malformed JSON at line {err.lineno} column {err.colno}: {err.msg}") \
            from None
    if not isinstance(cfg, dict):
        raise ConfigError("config.json: expected a JSON object with model_type, hidden_size, ...")
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    from memfit.io import write_text

    return str(write_text(workdir / f"config-{digest}" / "config.json", text))


def model_ref(form: Form, workdir: Path) -> str:
    """What ``--model`` would be: a preset name, a folder, or the path of the (pasted / uploaded) config."""
    if form.source == "preset":
        if not (form.preset or "").strip():
            raise ConfigError("model: pick a preset from the list")
        return form.preset.strip()
    if form.source == "folder":
        if not (form.folder or "").strip():
            raise ConfigError("model folder: give the path of a Hugging Face model folder (with config.json)")
        return str(Path(form.folder.strip()).expanduser())
    if form.source == "config.json":
        if form.config_file:
            try:
                text = Path(form.config_file).read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                raise ConfigError("config.json: the uploaded file cannot be read as UTF-8 text") from None
            return _save_config(text, workdir)
        if (form.config_text or "").strip():
            return _save_config(form.config_text, workdir)
        raise ConfigError("config.json: paste a model's config.json or upload the file")
    raise ConfigError(f"model source {form.source!r}: one of {', '.join(SOURCES)}")


def pool_text(form: Form) -> str:
    """The pool as ``--gpus`` takes it: '2xRTX4090-24GB', or '2x8xA100-80GB' for more than one node."""
    count = whole(form.count, "GPUs per node")
    nodes = whole(form.nodes, "nodes")
    if not (form.gpu or "").strip():
        raise ConfigError("GPU: pick a GPU kind from the catalog")
    return f"{nodes}x{count}x{form.gpu}" if nodes > 1 else f"{count}x{form.gpu}"


def methods(form: Form) -> Optional[list[str]]:
    """The methods to search in the registry's order; None when they are ``memfit plan``'s default set."""
    chosen = [m for m in ALL_METHODS if m in (form.methods or [])]
    if not chosen:
        raise ConfigError("methods: tick at least one method to consider")
    return None if tuple(chosen) == tuple(PLANNED) else chosen


def margin(form: Form) -> float:
    try:
        value = float(form.margin)
    except (TypeError, ValueError):
        raise ConfigError("margin: give the fraction of each GPU's memory kept free, e.g. 0.05") from None
    if not 0 <= value < 1:
        raise ConfigError(f"margin {value:g}: a fraction from 0 to below 1, e.g. 0.05 (5% kept free)")
    return value


def levers(form: Form) -> dict[str, Any]:
    """The long-context levers the user fixed, as ``memfit plan``'s flags fix them (strategy keys)."""
    fixed: dict[str, Any] = {}
    for key, name in (("sequence_parallel", "sequence parallel degree"), ("context_parallel",
                                                                         "context parallel degree")):
        degree = whole(getattr(form, key), f"{name} (0: the planner's choice)", low=0)
        if degree:
            fixed[key] = degree
    for key, allowed in (("activation_offload", OFFLOADS), ("tiled_mlp", TILED)):
        value = getattr(form, key) or CHOICE
        if value not in allowed:
            raise ConfigError(f"{key.replace('_', ' ')} {value!r}: one of {', '.join(allowed)}")
        if value != CHOICE:
            fixed[key] = value == "on" if key == "tiled_mlp" else value
    liger = form.liger or "off"
    if liger not in ("off", "on"):
        raise ConfigError(f"Liger Kernel {liger!r}: one of off, on")
    if liger == "on":
        fixed["liger"] = True
    return fixed


def plan_kwargs(form: Form) -> dict[str, Any]:
    """The keyword arguments ``memfit plan`` passes to memfit.plan.search.plan for the same flags."""
    return dict(methods=methods(form), zero_stages=None, allow_offload=True,
                seq_len=whole(form.seq_len, "sequence length"),
                micro_batch_size=whole(form.micro_batch, "micro-batch"),
                grad_accum=whole(form.grad_accum, "gradient accumulation"), margin=margin(form), fixed=levers(form))


def load(form: Form, workdir: Path) -> tuple[str, Any, Any]:
    """(model reference, ModelSpec, HardwareSpec) as ``memfit plan`` loads them; the custom memory size,
    when given, replaces the catalog card's (its speeds stay those of the kind picked)."""
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model

    pool = pool_text(form)
    ref = model_ref(form, workdir)
    hw = parse_hardware(pool, cpu_ram=gb_text(form.cpu_ram_gb, "CPU RAM"))
    custom = gb_text(form.custom_gb, "custom memory per GPU")
    if custom is not None:
        hw = replace(hw, gpu=replace(hw.gpu, memory_bytes=int(float(form.custom_gb) * 1e9)))
    return ref, resolve_model(ref), hw


def command_line(form: Form, ref: str, emit_dir: str = "run-config/") -> Optional[str]:
    """The ``memfit plan`` command for the same inputs (None with a custom memory size: the command line
    takes catalog GPUs only)."""
    if gb_text(form.custom_gb, "custom memory per GPU") is not None:
        return None
    kw = plan_kwargs(form)
    args = ["memfit", "plan", "--model", ref, "--gpus", pool_text(form), "--seq-len", str(kw["seq_len"]),
            "--batch-size", str(kw["micro_batch_size"])]
    if kw["grad_accum"] != 1:
        args += ["--grad-accum", str(kw["grad_accum"])]
    ram = gb_text(form.cpu_ram_gb, "CPU RAM")
    if ram is not None:
        args += ["--cpu-ram", ram]
    if kw["methods"] is not None:
        args += ["--methods", ",".join(kw["methods"])]
    if kw["margin"] != DEFAULT_MARGIN:
        args += ["--margin", repr(kw["margin"])]
    for key, value in kw["fixed"].items():  # the levers, as their flags
        flag = "--" + key.replace("_", "-")
        args += [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    args += ["--emit", emit_dir]
    return " ".join(shlex.quote(a) for a in args)
