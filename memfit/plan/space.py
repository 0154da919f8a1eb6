"""The search space: every combination of levers the planner tries, as validated Strategy objects.

method × gradient checkpointing × attention × engine (DDP, ZeRO-1/2/3, FSDP2 and FSDP1 full_shard/shard_grad_op)
× offload × loss (standard, chunked cross-entropy), at one precision per device (bf16-mixed where supported, else
fp16-mixed; fp32 on the CPU).
Keys the user fixes (``fixed``) are held; combinations the Strategy validator refuses (offload without
an engine, parameter offload without parameter sharding) do not exist and are skipped silently.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable, Iterator, Optional

from pydantic import ValidationError

from memfit.errors import ConfigError
from memfit.methods import METHODS as REGISTRY, NAMES as METHODS, PLANNED
from memfit.methods.qlora import PARAM_DTYPE
from memfit.plan import rules
from memfit.spec.strategy import ATTENTIONS, FSDP_VERSIONS, LOSSES, OFFLOADS, Strategy

# (zero_stage, fsdp, fsdp_version) per engine, fastest-to-leanest order; FSDP2 before FSDP1, so that where
# both price the same the planner keeps FSDP2 (memfit's default), and FSDP1 wins only where it is better.
ENGINES: tuple[tuple[int, Any, int], ...] = (
    (0, False, 2), (1, False, 2), (2, False, 2), (3, False, 2), (0, "shard_grad_op", 2), (0, "full_shard", 2),
    (0, "shard_grad_op", 1), (0, "full_shard", 1),
)
ENGINE_KEYS = ("zero_stage", "fsdp")  # the Strategy keys an engine tuple above begins with
# the keys enumerate_strategies loops over (the rest of ``fixed`` is held as given)
LOOPED_KEYS = frozenset(("method", "offload", "gradient_checkpointing", "attention", *ENGINE_KEYS, "fsdp_version",
                         "loss"))
STRATEGY_FIELDS = frozenset(Strategy.model_fields)
# The command-line flag of each strategy key whose name differs from it.
FLAGS = {"zero_stage": "--zero", "micro_batch_size": "--batch-size", "gradient_checkpointing":
         "--gradient-checkpointing"}


def strategy_error(err: ValidationError, source: str = "strategy") -> ConfigError:
    """One line naming the field(s) pydantic refused, the value given and what is allowed."""
    by_field: dict[str, list[str]] = {}
    given: dict[str, Any] = {}
    for e in err.errors():
        loc = str(e["loc"][0]) if e["loc"] else "strategy"
        msg = e["msg"].removeprefix("Value error, ").removeprefix("Input should be ")
        by_field.setdefault(loc, []).append(msg)
        if loc != "strategy" and "input" in e and not isinstance(e["input"], dict):
            given[loc] = e["input"]
    parts = []
    for loc, msgs in by_field.items():
        if loc == "strategy":
            parts.append("; ".join(msgs))
            continue
        flag = FLAGS.get(loc, "--" + loc.replace("_", "-"))
        got = f"got {given[loc]!r}; " if loc in given else ""
        parts.append(f"{loc} ({flag}): {got}should be " + " or ".join(msgs))
    return ConfigError(f"{source}: " + "; ".join(parts))


def make_strategy(**keys: Any) -> Strategy:
    """Strategy(**keys), with a one-line ConfigError naming the field on a bad value or combination."""
    unknown = sorted(set(keys) - STRATEGY_FIELDS)
    if unknown:
        raise ConfigError(f"strategy: unknown key(s) {', '.join(unknown)}; allowed: "
                          + ", ".join(sorted(STRATEGY_FIELDS)))
    try:
        return Strategy(**keys)
    except ValidationError as err:
        raise strategy_error(err) from None


def _check_choices(name: str, values: Iterable[Any], allowed: Iterable[Any]) -> list[Any]:
    values, allowed = list(values), list(allowed)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ConfigError(f"{name}: {', '.join(map(str, bad)) or '(empty)'} not allowed; choose from "
                          + ", ".join(map(str, allowed)))
    return values


def engines_for(zero_stages: Optional[Iterable[int]], fixed: dict[str, Any]) -> list[tuple[int, Any, int]]:
    """Engines to try. ``zero_stages`` restricts the search to DeepSpeed stages (0 = DDP), no FSDP;
    a fixed ``zero_stage`` / ``fsdp`` / ``fsdp_version`` holds that key (the version binds FSDP only)."""
    engines = list(ENGINES)
    if all(key in fixed for key in ENGINE_KEYS):
        make_strategy(**{key: fixed[key] for key in ENGINE_KEYS})  # raises if they contradict
    if "fsdp_version" in fixed:
        _check_choices("fsdp_version (--fsdp-version)", [fixed["fsdp_version"]], FSDP_VERSIONS)
        engines = [(z, f, v) for z, f, v in engines if not f or v == fixed["fsdp_version"]]
    if zero_stages is not None:
        stages = _check_choices("--zero-stages", zero_stages, (0, 1, 2, 3))
        if not fixed.get("fsdp"):
            engines = [(z, f, v) for z, f, v in engines if not f and z in stages]
    for i, key in enumerate(ENGINE_KEYS):
        if key in fixed:
            engines = [e for e in engines if e[i] == fixed[key]]
    if not engines:
        raise ConfigError(f"--zero {fixed.get('zero_stage')} is not among --zero-stages "
                          f"{','.join(map(str, zero_stages or ()))}; drop one of them")
    return engines


def enumerate_strategies(
    model: Any,
    hardware: Any,
    *,
    methods: Optional[Iterable[str]] = None,
    zero_stages: Optional[Iterable[int]] = None,
    allow_offload: bool = True,
    offloads: Optional[Iterable[str]] = None,
    seq_len: int,
    micro_batch_size: int,
    grad_accum: int = 1,
    fixed: Optional[dict[str, Any]] = None,
) -> Iterator[Strategy]:
    """Every existing combination of the levers, holding the keys in ``fixed``."""
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - STRATEGY_FIELDS)
    if unknown:
        raise ConfigError(f"fixed strategy key(s) {', '.join(unknown)} unknown; allowed: "
                          + ", ".join(sorted(STRATEGY_FIELDS)))
    for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size), ("grad_accum", grad_accum)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value}: must be a positive integer")
    methods = _check_choices("--methods", methods if methods is not None else PLANNED, METHODS)
    if "method" in fixed:
        methods = [fixed["method"]]
    if offloads is None:
        offloads = OFFLOADS if allow_offload else ("none",)
    offloads = _check_choices("offload", offloads, OFFLOADS)
    if "offload" in fixed:
        offloads = [fixed["offload"]]
    gcs = [fixed["gradient_checkpointing"]] if "gradient_checkpointing" in fixed else [False, True]
    attentions = [fixed["attention"]] if "attention" in fixed else list(ATTENTIONS)
    losses = [fixed["loss"]] if "loss" in fixed else list(LOSSES)
    precision = fixed.get("precision", rules.default_precision(hardware))
    base = {k: v for k, v in fixed.items() if k not in LOOPED_KEYS}
    base.update(seq_len=seq_len, micro_batch_size=micro_batch_size, grad_accum=grad_accum, precision=precision)
    if "lora_targets" not in fixed:
        base["lora_targets"] = rules.default_lora_targets(model, Strategy.model_fields["lora_targets"].default)
    engines = engines_for(zero_stages, fixed)
    # One device: sharding over it saves nothing, so ZeRO/FSDP only matter with offload (unless asked for).
    one_device = hardware.world_size == 1 and not (set(ENGINE_KEYS) & set(fixed))
    args = (tuple(methods), tuple(engines), tuple(offloads), tuple(gcs), tuple(attentions),
            tuple(sorted(base.items())), tuple(sorted(k for k in fixed if k == "quant_storage")), one_device,
            tuple(losses))
    try:
        space = _space(*args)
    except TypeError:  # an unhashable fixed value: build without the cache
        space = _space.__wrapped__(*args)
    return iter(space)


@lru_cache(maxsize=256)
def _space(methods: tuple, engines: tuple, offloads: tuple, gcs: tuple, attentions: tuple,
           base_items: tuple, fixed_storage: tuple, one_device: bool = False,
           losses: tuple = ("standard",)) -> tuple[Strategy, ...]:
    """The combinations for one set of choices (cached: a matrix reuses them across models)."""
    base = dict(base_items)
    precision = base["precision"]
    out = []
    for method in methods:
        for zero, fsdp, version in engines:
            keys = dict(base, method=method, zero_stage=zero, fsdp=fsdp, fsdp_version=version)
            if REGISTRY[method].quantized and not fixed_storage:
                sharded = zero == 3 or bool(fsdp)
                keys["quant_storage"] = PARAM_DTYPE[precision] if sharded else "uint8"
            for offload in offloads:
                if one_device and offload == "none" and (zero or fsdp):
                    continue
                for gc in gcs:
                    for attention in attentions:
                        for loss in losses:
                            try:
                                out.append(Strategy(**keys, offload=offload, gradient_checkpointing=gc,
                                                    attention=attention, loss=loss))
                            except ValidationError:
                                continue  # a combination that does not exist (e.g. offload without an engine)
    return tuple(out)
