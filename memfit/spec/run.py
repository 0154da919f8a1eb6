"""One typed description of a run: model, hardware, data, the chosen optimizations and the schedule.

``memfit plan --emit`` writes it, ``memfit train`` and ``memfit measure`` read it. The run file is YAML
with these sections; unknown keys are errors. Two convenience sections map onto strategy keys:
``lora: {r, alpha, dropout, targets, rslora, modules_to_save, rank_pattern, alpha_pattern}`` → ``strategy.lora_*`` and
``meft: {neurons, top_k, experts, n_probe}`` → ``strategy.meft_*`` (so ``--set lora.r=32`` works too);
``peft_config: {peft_type: IA3, ...}`` (or an adapter_config.json path) → ``strategy.peft_config``, method peft.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from memfit.errors import ConfigError
from memfit.methods.lora.config import SECTION as LORA_SECTION
from memfit.methods.meft.config import SECTION as MEFT_SECTION
from memfit.spec.strategy import Strategy
from memfit.spec.phases import EvalSpec, RunPhases, SaveSpec

DataFormat = Literal["auto", "prompt_completion", "dialogue_summary", "chat", "text"]


class DataSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Optional[str] = Field(None, description="JSONL file or datasets folder; null = embedded demo data")
    format: DataFormat = "auto"
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    packing: bool = False
    max_samples: Optional[int] = Field(None, ge=1)


class TrainingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_steps: int = Field(30, ge=1)
    epochs: Optional[float] = Field(None, gt=0)
    learning_rate: float = Field(2e-4, gt=0)
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    eval_interval: int = Field(0, ge=0, description="steps between evaluations; 0 = only at the end")
    checkpoint_interval: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    logging_interval: int = Field(1, ge=1)
    seed: int = Field(0, ge=0, le=2**32 - 1, description="random seed (numpy accepts 0 .. 2**32-1)")


DEFAULT_PORT = 29500  # torchrun's and accelerate's default rendezvous port


class DistributedSpec(BaseModel):
    """How processes are laid out; the sharding engine itself is chosen in ``strategy``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nproc: int = Field(1, ge=1, description="processes (devices) per node")
    nodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = Field(None, ge=1, le=65535, description="node 0's rendezvous port; default: "
                                       "a free port on one node, 29500 across nodes (every node names it)")
    reduce_bucket_size: Optional[int] = Field(None, ge=1)
    allgather_bucket_size: Optional[int] = Field(None, ge=1)
    timeout_s: int = Field(600, ge=1, description="seconds a collective waits for the other ranks before "
                           "every process stops (a dead or hung rank); above the longest checkpoint save")


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(..., description="preset name, model folder, path to a config.json, or Hugging Face "
                       "Hub id owner/name[@revision] (training loads its weights by id; never remote code)")
    hardware: str = Field("local", description="'local' or a pool such as '2xRTX3090-24GB'")
    cpu_ram: Optional[str] = Field(None, description="CPU RAM of a node, e.g. '128GB'; default: detect/catalog")
    data: DataSpec = DataSpec()
    strategy: Strategy = Strategy()
    training: TrainingSpec = TrainingSpec()
    distributed: DistributedSpec = DistributedSpec()
    eval: EvalSpec = EvalSpec()
    save: SaveSpec = SaveSpec()
    output_dir: str = Field("runs/memfit", description="folder for the run's files")
    rope_scaling: Optional[dict[str, Any]] = Field(None, description="RoPE scaling applied to the model's config "
                                                   "(replaces its own), e.g. {rope_type: yarn, factor: 4.0}; "
                                                   "memfit.spec.context")

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _rope_scaling(cls, v: Any) -> Any:
        from memfit.spec.context import check_rope_scaling

        return check_rope_scaling(v)

    @property
    def phases(self) -> RunPhases:
        """The keys the estimator's run phases read (memfit.spec.phases)."""
        return RunPhases(eval=self.eval, save=self.save)

    @field_validator("output_dir", mode="before")
    @classmethod
    def _output_dir_given(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and not v.strip()):
            raise ValueError("empty; give a folder for the run's files, e.g. --set output_dir=runs/my-run")
        return v


_SECTION_ALIASES = dict((LORA_SECTION, MEFT_SECTION))  # each method's run-file section, from its folder
_TOP_LEVEL_SHORTCUTS = {"max_steps": "training.max_steps", "seed": "training.seed",
                        "learning_rate": "training.learning_rate", "method": "strategy.method"}


def _fold_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    strategy = dict(raw.get("strategy") or {})
    for section, keys in _SECTION_ALIASES.items():
        if section not in raw:
            continue
        values = raw.pop(section)
        if not isinstance(values, dict):
            raise ConfigError(f"run file: section '{section}' must be a mapping of {sorted(keys)}")
        for key, value in values.items():
            if key not in keys:
                raise ConfigError(
                    f"run file: unknown key '{section}.{key}'; allowed: {', '.join(sorted(keys))}"
                )
            strategy[keys[key]] = value
    if "peft_config" in raw:  # the run file's peft_config: block (a mapping or an adapter_config.json path)
        strategy["peft_config"] = raw.pop("peft_config")
        if "method" not in (raw.get("strategy") or {}) and "method" not in raw:
            strategy["method"] = "peft"
    for short, dotted in _TOP_LEVEL_SHORTCUTS.items():
        if short in raw:
            section, key = dotted.split(".")
            raw.setdefault(section, {})
            raw[section] = {**raw[section], key: raw.pop(short)}
    raw["strategy"] = {**(raw.get("strategy") or {}), **strategy}
    return raw


def _parse_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars/lists) to a raw run dict."""
    raw = _fold_aliases(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set strategy.lora_r=32")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) == 2 and parts[0] in _SECTION_ALIASES:
            alias = _SECTION_ALIASES[parts[0]]
            if parts[1] not in alias:
                raise ConfigError(f"--set {dotted}: unknown key; allowed: "
                                  + ", ".join(f"{parts[0]}.{k}" for k in sorted(alias)))
            parts = ["strategy", alias[parts[1]]]
        elif len(parts) == 1 and parts[0] in _TOP_LEVEL_SHORTCUTS:
            parts = _TOP_LEVEL_SHORTCUTS[parts[0]].split(".")
        node = raw
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {dotted}: '{part}' is not a section")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = _parse_value(text)
    return _fold_aliases(raw) if "peft_config" in raw else raw  # --set peft_config=PATH_OR_MAPPING


def format_validation_error(err: ValidationError, source: str) -> str:
    """One readable line per problem: where, what, and what is allowed."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see the README's run file reference)"
        lines.append(f"{source}: {loc or '(top level)'}: {msg}")
    return "\n".join(lines)


def run_from_dict(raw: dict[str, Any], overrides: list[str] = (), source: str = "run file") -> RunSpec:
    raw = apply_overrides(raw or {}, list(overrides))
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def yaml_error_line(err: Exception, path: Any) -> str:
    """One line: file:line:column: the problem (PyYAML's message without its context dump)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    return f"{where}: not valid YAML: {problem}"


def _unique_key_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(loader, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice (first on line {seen[key] + 1}); keep one",
                    mark)
            seen[key] = key_node.start_mark.line
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


class _LazyLoader:
    _cls = None

    def __call__(self, stream):
        if _LazyLoader._cls is None:
            _LazyLoader._cls = _unique_key_loader()
        return _LazyLoader._cls(stream)


_UniqueKeyLoader = _LazyLoader()


def load_run(path: str | Path, overrides: list[str] = ()) -> RunSpec:
    """Read and validate a YAML run file; every mistake becomes a ConfigError naming the field."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"run file {path} not found; write one or use `memfit plan ... --emit DIR`")
    try:
        raw = yaml.load(path.read_bytes(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(yaml_error_line(err, path)) from None
    except OSError as err:
        raise ConfigError(f"run file {path}: cannot read ({err.strerror})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the run file must be a mapping of sections (model, data, strategy, ...)")
    return run_from_dict(raw, overrides, source=str(path))


def dump_run(run: RunSpec) -> str:
    """The run file text for ``run`` (round-trips through ``load_run``)."""
    import json

    import yaml

    data = run.model_dump(mode="json")
    if data.get("rope_scaling") is None:  # written only when set
        data.pop("rope_scaling", None)
    data["strategy"]["lora_targets"] = list(run.strategy.lora_targets)
    for key in ("lora_modules_to_save", "lora_rank_pattern", "lora_alpha_pattern"):  # as the run file writes them
        value = getattr(run.strategy, key)
        data["strategy"][key] = dict(value) if key.endswith("pattern") else list(value)
    if run.strategy.peft_config is not None:  # the PEFT config as a mapping, as it was written
        data["strategy"]["peft_config"] = json.loads(run.strategy.peft_config)
    return yaml.safe_dump(data, sort_keys=False)


def save_run(run: RunSpec, path: str | Path) -> Path:
    """Write the run file atomically (memfit.io: umask permissions, one line on a write failure)."""
    from memfit.io import write_text

    return write_text(path, dump_run(run), "run file")
