"""Try every combination of levers, keep those that run and fit, and recommend the fastest.

``plan(model, hardware, ...) -> Plan``: ``recommended`` (an Estimate or None), ``candidates`` (fitting,
ranked by predicted step time), ``rejected`` (``{"strategy", "reason"}``: rule failures and memory
shortfalls with the amount missed) and ``why`` (sentences explaining the choice).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from memfit.errors import ConfigError
from memfit.plan import facts, rules
from memfit.plan.space import enumerate_strategies
from memfit.spec.strategy import Strategy


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


@dataclass
class Rejection:
    strategy: Strategy
    reason: str
    kind: str  # "rule" | "memory"
    estimate: Any = None
    reasons: list = field(default_factory=list)  # rule failures, one sentence each
    short_bytes: float = 0.0  # how much memory it missed by (GPU or CPU, whichever is worse)
    over_ratio: float = 0.0  # need / usable of the binding resource

    def to_dict(self) -> dict:
        return {"strategy": self.strategy.model_dump(mode="json"), "reason": self.reason}


@dataclass
class Plan:
    model: Any
    hardware: Any
    margin: float
    recommended: Any = None
    candidates: list = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    why: list[str] = field(default_factory=list)

    @property
    def closest(self) -> Optional[Rejection]:
        """The memory-rejected combination nearest to fitting (what to aim for when nothing fits)."""
        mem = [r for r in self.rejected if r.kind == "memory"]
        return min(mem, key=lambda r: (r.over_ratio, r.estimate.step_seconds)) if mem else None

    def to_dict(self) -> dict:
        return {
            "recommended": self.recommended.to_dict() if self.recommended is not None else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "rejected": [r.to_dict() for r in self.rejected],
            "why": list(self.why),
        }


def usable(capacity: Optional[float], margin: float) -> Optional[float]:
    return None if not capacity else capacity * (1.0 - margin)


def memory_verdict(est: Any, hardware: Any, margin: float) -> Optional[tuple[str, float, float]]:
    """None if ``est`` fits with ``margin`` kept free, else (reason, bytes short, need/usable)."""
    gpu_cap = usable(facts.gpu_memory_bytes(hardware), margin)
    cpu_cap = usable(facts.cpu_ram_bytes(hardware), margin)
    problems: list[tuple[float, str, float]] = []
    if gpu_cap and est.gpu_total > gpu_cap:
        short = est.gpu_total - gpu_cap
        problems.append((est.gpu_total / gpu_cap,
                         f"needs {_gb(est.gpu_total)} per GPU, has {_gb(gpu_cap)} usable "
                         f"({facts.gpu_name(hardware)} less the {margin:.0%} margin): {_gb(short)} short", short))
    if cpu_cap and est.cpu_total > cpu_cap:
        short = est.cpu_total - cpu_cap
        problems.append((est.cpu_total / cpu_cap,
                         f"needs {_gb(est.cpu_total)} of CPU RAM per node, has {_gb(cpu_cap)} usable: "
                         f"{_gb(short)} short", short))
    if not problems and not est.fits:
        text = "; ".join(est.reasons) or "does not fit"
        return text, 0.0, 1.0
    if not problems:
        return None
    problems.sort(reverse=True)
    return "; ".join(p[1] for p in problems), problems[0][2], problems[0][0]


def _rank_key(est: Any) -> tuple:
    return (est.step_seconds, est.gpu_total, est.cpu_total)


def plan(
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
    margin: float = 0.05,
    profile: Any = None,
    fixed: Optional[dict[str, Any]] = None,
    explain: bool = True,
) -> Plan:
    """Search the levers for ``model`` on ``hardware``; recommend the fastest combination that fits."""
    from memfit.estimate import estimate

    if not 0.0 <= margin < 1.0:
        raise ConfigError(f"--margin {margin}: must be a fraction in [0, 1), e.g. 0.05 keeps 5% free")
    result = Plan(model=model, hardware=hardware, margin=margin)
    tried = 0
    for strategy in enumerate_strategies(
        model, hardware, methods=methods, zero_stages=zero_stages, allow_offload=allow_offload,
        offloads=offloads, seq_len=seq_len, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
        fixed=fixed,
    ):
        tried += 1
        reasons = rules.check(model, hardware, strategy)
        if reasons:
            result.rejected.append(Rejection(strategy, " Also: ".join(reasons), "rule", reasons=reasons))
            continue
        est = estimate(model, hardware, strategy, profile=profile)
        verdict = memory_verdict(est, hardware, margin)
        if verdict is None:
            result.candidates.append(est)
        else:
            reason, short, ratio = verdict
            result.rejected.append(Rejection(strategy, reason, "memory", est, short, ratio))
    if not tried:
        raise ConfigError("the fixed strategy keys leave no combination to try (e.g. offload needs "
                          "zero_stage>=1 or fsdp); loosen --method/--zero/--fsdp/--offload")
    result.candidates.sort(key=_rank_key)
    result.recommended = result.candidates[0] if result.candidates else None
    if explain:
        result.why = explain_plan(result)
    return result


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.0f}%" if b else "n/a"


def explain_plan(p: Plan) -> list[str]:
    """Sentences: what was chosen and why, what the runner-ups cost, what did not fit and by how much."""
    why: list[str] = []
    rec = p.recommended
    n_tried = len(p.candidates) + len(p.rejected)
    n_rule = sum(1 for r in p.rejected if r.kind == "rule")
    n_mem = len(p.rejected) - n_rule
    gpu_cap = facts.gpu_memory_bytes(p.hardware)
    if rec is not None:
        why.append(
            f"{rec.strategy.label()} is the fastest of the {len(p.candidates)} combinations that fit "
            f"({n_tried} tried): {rec.step_seconds:.3g} s/step using {_gb(rec.gpu_total)} of "
            f"{_gb(gpu_cap)} per GPU with {p.margin:.0%} kept free."
        )
        seen = {rec.strategy.label()}
        for c in p.candidates[1:]:
            if len(seen) >= 4:
                break
            if c.strategy.label() in seen:
                continue
            seen.add(c.strategy.label())
            why.append(f"Runner-up {c.strategy.label()}: {c.step_seconds:.3g} s/step "
                       f"({_pct(c.step_seconds, rec.step_seconds)}), {_gb(c.gpu_total)} per GPU.")
        faster = sorted((r for r in p.rejected if r.kind == "memory" and r.estimate is not None
                         and r.estimate.step_seconds < rec.step_seconds),
                        key=lambda r: r.estimate.step_seconds)
        for r in faster[:3]:
            why.append(f"Faster but does not fit: {r.strategy.label()} "
                       f"({r.estimate.step_seconds:.3g} s/step, {_pct(r.estimate.step_seconds, rec.step_seconds)}) "
                       f"{r.reason}.")
    else:
        why.append(f"Nothing fits: {n_mem} of {n_tried} combinations exceed memory, {n_rule} cannot run here.")
        close = p.closest
        if close is not None:
            why.append(f"Closest: {close.strategy.label()} {close.reason}.")
            why.extend(what_would_fit(p, close))
    if n_rule:
        groups = Counter(r.reasons[0] for r in p.rejected if r.kind == "rule")
        for reason, count in groups.most_common(2):
            why.append(f"Ruled out ({count} combinations): {reason}")
    return why


def what_would_fit(p: Plan, close: Rejection) -> list[str]:
    """Concrete changes that would let the closest combination fit."""
    hints = []
    est, margin = close.estimate, p.margin
    gpu_cap = facts.gpu_memory_bytes(p.hardware)
    if est is not None and gpu_cap and est.gpu_total > gpu_cap * (1 - margin):
        need = est.gpu_total / (1 - margin)
        hints.append(f"It would fit on GPUs with at least {_gb(need)} each, or with more GPUs to shard over "
                     f"(try --nodes {facts.nodes(p.hardware) * 2}), or with a shorter --seq-len.")
    ram = facts.cpu_ram_bytes(p.hardware)
    if est is not None and ram and est.cpu_total > ram * (1 - margin):
        need = est.cpu_total / (1 - margin)
        hints.append(f"It needs --cpu-ram of at least {_gb(need)} per node.")
    return hints
