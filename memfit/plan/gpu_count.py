"""Search the GPU count too: per count, the best plan's step time, CPU RAM need, total time and cost.

``gpu_count_search(model, gpu="RTX3090-24GB", max_gpus=8, ...)`` plans 1..max_gpus GPUs of one kind on
one node. Given ``tokens`` (tokens to train on) or ``steps`` it adds the run's hours, and with a price
per GPU-hour its cost, so "a third GPU cuts CPU RAM and time" (seed 004) reads off one table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from memfit.errors import ConfigError
from memfit.plan.search import Plan, plan


def run_length(est: Any, gpus: int, *, tokens: Optional[int] = None, steps: Optional[int] = None,
               price: Optional[float] = None) -> dict[str, Optional[float]]:
    """Steps, hours and cost of a run of ``tokens`` (or ``steps`` optimizer steps) with ``est``'s plan on
    ``gpus`` GPUs; a step processes gpus x micro-batch x accumulation x seq_len tokens."""
    s = est.strategy
    per_step = gpus * s.micro_batch_size * s.grad_accum * s.seq_len
    n = math.ceil(tokens / per_step) if tokens is not None else steps
    hours = n * est.step_seconds / 3600.0 if n is not None else None
    cost = hours * gpus * price if hours is not None and price is not None else None
    return {"steps": n, "hours": hours, "cost": cost, "tokens_per_step": per_step}


def check_run_args(tokens: Optional[int], steps: Optional[int], price: Optional[float]) -> None:
    """One-line errors for the run-length flags."""
    if tokens is not None and steps is not None:
        raise ConfigError("--tokens and --steps both given: give one (tokens to train on, or optimizer steps)")
    for name, value in (("--tokens", tokens), ("--steps", steps)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} {value}: must be a positive integer")
    if price is not None and price < 0:
        raise ConfigError(f"--gpu-hour-price {price}: must be >= 0 (a price per GPU-hour, e.g. 0.33)")


@dataclass
class CountRow:
    gpus: int
    plan: Plan
    steps: Optional[int] = None
    hours: Optional[float] = None
    cost: Optional[float] = None

    @property
    def recommended(self) -> Any:
        return self.plan.recommended

    @property
    def tokens_per_step(self) -> int:
        s = self.recommended.strategy
        return self.gpus * s.micro_batch_size * s.grad_accum * s.seq_len

    def to_dict(self) -> dict:
        rec = self.recommended
        return {
            "gpus": self.gpus,
            "recommended": rec.to_dict() if rec is not None else None,
            "step_seconds": rec.step_seconds if rec is not None else None,
            "gpu_bytes": rec.gpu_total if rec is not None else None,
            "cpu_bytes": rec.cpu_total if rec is not None else None,
            "steps": self.steps,
            "hours": self.hours,
            "cost": self.cost,
        }


@dataclass
class GpuCountResult:
    gpu: str
    price: Optional[float]
    rows: list[CountRow] = field(default_factory=list)

    @property
    def best(self) -> Optional[CountRow]:
        """The cheapest row when a price and a run length are known, else the fastest per token."""
        fitting = [r for r in self.rows if r.recommended is not None]
        if not fitting:
            return None
        if all(r.cost is not None for r in fitting):
            return min(fitting, key=lambda r: (r.cost, r.hours))
        if all(r.hours is not None for r in fitting):
            return min(fitting, key=lambda r: r.hours)
        return min(fitting, key=lambda r: r.recommended.step_seconds / r.tokens_per_step)

    def to_dict(self) -> dict:
        best = self.best
        return {"gpu": self.gpu, "gpu_hour_price": self.price,
                "rows": [r.to_dict() for r in self.rows], "best_gpus": best.gpus if best else None}


def gpu_count_search(
    model: Any,
    gpu: str,
    *,
    max_gpus: int,
    cpu_ram: Optional[str] = None,
    price: Optional[float] = None,
    tokens: Optional[int] = None,
    steps: Optional[int] = None,
    **plan_kwargs: Any,
) -> GpuCountResult:
    """Plan on 1..``max_gpus`` GPUs of kind ``gpu`` and add total time and cost per count."""
    from memfit.spec.hardware import parse_hardware

    if max_gpus < 1:
        raise ConfigError(f"--max-gpus {max_gpus}: must be at least 1")
    check_run_args(tokens, steps, price)
    if "x" in gpu.lower().split("-")[0] and gpu.lower().split("x")[0].isdigit():
        raise ConfigError(f"--gpu {gpu}: give one GPU kind without a count (e.g. RTX3090-24GB); "
                          "--max-gpus sets the counts to try")
    result = GpuCountResult(gpu=gpu, price=price)
    for n in range(1, max_gpus + 1):
        hardware = parse_hardware(f"{n}x{gpu}", cpu_ram=cpu_ram)
        row = CountRow(gpus=n, plan=plan(model, hardware, **plan_kwargs))
        rec = row.recommended
        if rec is not None:
            length = run_length(rec, n, tokens=tokens, steps=steps, price=price)
            row.steps, row.hours, row.cost = length["steps"], length["hours"], length["cost"]
        result.rows.append(row)
    return result
