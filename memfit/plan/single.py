"""Estimate ONE combination the user named, with the planner's defaults for the keys left out, the
rules (can it run here at all?) and the safety margin (does it fit with room to spare?)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memfit.errors import ConfigError
from memfit.methods import METHODS
from memfit.methods.qlora import PARAM_DTYPE
from memfit.plan import rules
from memfit.plan.space import make_strategy
from memfit.spec.strategy import Strategy


def complete_keys(model: Any, hardware: Any, keys: dict[str, Any]) -> dict[str, Any]:
    """Fill what the user left out the way the planner would: precision for the device, LoRA targets
    the model has, and QLoRA's quant storage equal to the parameter dtype under ZeRO-3/FSDP."""
    keys = dict(keys)
    keys.setdefault("precision", rules.default_precision(hardware))
    if "lora_targets" not in keys:
        keys["lora_targets"] = rules.default_lora_targets(model, Strategy.model_fields["lora_targets"].default)
    method = METHODS.get(keys.get("method", Strategy.model_fields["method"].default))
    if method is not None and method.quantized and "quant_storage" not in keys:
        sharded = keys.get("zero_stage", 0) == 3 or keys.get("fsdp") not in (None, False)
        keys["quant_storage"] = PARAM_DTYPE.get(keys["precision"], "bf16") if sharded else "uint8"
    return keys


@dataclass
class SingleEstimate:
    estimate: Any
    margin: float
    rule_reasons: list[str] = field(default_factory=list)

    @property
    def strategy(self) -> Strategy:
        return self.estimate.strategy

    @property
    def fits(self) -> bool:
        return bool(self.estimate.fits) and not self.rule_reasons

    @property
    def reasons(self) -> list[str]:
        out = list(self.rule_reasons)
        for r in self.estimate.reasons:
            if r not in out:
                out.append(r)
        return out

    def to_dict(self) -> dict:
        d = self.estimate.to_dict()
        d["fits"] = self.fits
        d["reasons"] = self.reasons
        d["margin"] = self.margin
        return d


def check_margin(margin: float) -> None:
    """The planner's one check of ``--margin`` (the fraction of GPU memory kept free)."""
    if not 0.0 <= margin < 1.0:
        raise ConfigError(f"--margin {margin}: must be a fraction in [0, 1), e.g. 0.05 keeps 5% free")


def estimate_one(model: Any, hardware: Any, keys: dict[str, Any], *, margin: float = 0.05,
                 profile: Any = None, activation_formula: Any = None, phases: Any = None) -> SingleEstimate:
    """The estimate of the combination ``keys`` (Strategy fields), checked against rules and margin."""
    from memfit.estimate import estimate

    strategy = make_strategy(**complete_keys(model, hardware, keys))
    check_margin(margin)
    est = estimate(model, hardware, strategy, profile=profile, margin=margin,
                   activation_formula=activation_formula, phases=phases)
    return SingleEstimate(est, margin, rules.check(model, hardware, strategy))
