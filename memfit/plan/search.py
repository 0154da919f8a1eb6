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
from memfit.estimate.host import node_ram
from memfit.estimate.phases import NAMES
from memfit.methods import METHODS
from memfit.plan import rules
from memfit.plan.longctx import lever_note
from memfit.plan.longctx import variants as long_context_variants
from memfit.plan.single import check_margin
from memfit.plan.space import enumerate_strategies, make_strategy
from memfit.spec import context
from memfit.spec.strategy import Strategy


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _sec(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.3g}"


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
    search_args: dict = field(default_factory=dict, repr=False)

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


def _memory(est: Any, hardware: Any) -> str:
    if hardware.gpu.is_cpu:
        return f"{_gb(ram_need(est, hardware))} of RAM"
    return f"{_gb(est.gpu_total)} per GPU"


def ram_need(est: Any, hardware: Any) -> float:
    """On the CPU device one RAM holds every process's "device" lines plus the process/offload lines."""
    return node_ram(hardware.gpus_per_node, est.gpu_total, est.cpu_total)


def memory_verdict(est: Any, hardware: Any) -> Optional[tuple[str, float, float]]:
    """None if ``est`` fits (the estimator applies the margin), else (reason, bytes short, need/usable)."""
    if est.fits:
        return None
    reason = "; ".join(est.reasons) or "does not fit"
    usable_gpu = float(est.usable_gpu_bytes) or 1.0
    if hardware.gpu.is_cpu:  # one RAM holds the "device" lines and the process
        need = ram_need(est, hardware)
        return reason, max(need - usable_gpu, 0.0), need / usable_gpu
    worst = [(est.gpu_needed / usable_gpu, est.gpu_needed - usable_gpu)]  # the cache beyond the card is freed
    ram = float(hardware.cpu_ram_bytes)
    if ram:
        worst.append((est.cpu_total / ram, est.cpu_total - ram))
    ratio, short = max(worst)
    return reason, max(short, 0.0), ratio


def short_reason(est: Any, hardware: Any) -> str:
    """'needs 207.2 GB per GPU (32.6 GB usable)' and/or the CPU RAM shortfall, in few words."""
    usable_gpu = float(est.usable_gpu_bytes)
    if hardware.gpu.is_cpu:
        return f"needs {_gb(ram_need(est, hardware))} of RAM ({_gb(usable_gpu)} usable)"
    parts = []
    if est.gpu_needed > usable_gpu:
        when = "" if est.gpu_phase == "train_step" else f" while {NAMES[est.gpu_phase]}"
        parts.append(f"needs {_gb(est.gpu_needed)} per GPU{when} ({_gb(usable_gpu)} usable, "
                     f"{_gb(est.gpu_needed - usable_gpu)} over)")
    ram = float(hardware.cpu_ram_bytes)
    if ram and est.cpu_total > ram:
        when = "" if est.cpu_phase in ("training", "loading") else f" while {est.cpu_phase}"
        parts.append(f"needs {_gb(est.cpu_total)} of CPU RAM per node{when} (node has {_gb(ram)})")
    return " and ".join(parts) or "; ".join(est.reasons)


def rule_key(s: Strategy, model: Any = None) -> tuple:
    """The fields the rules read (everything but lengths, batch and checkpointing). Keep in step with
    memfit.plan.rules: a rule that reads another field must add it here. The length counts for a model with
    learned positions (memfit.spec.context), passed as ``model``."""
    return (s.method, s.zero_stage, s.fsdp, s.offload, s.attention, s.optimizer, s.precision, s.quant_storage,
            s.lora_targets, s.meft_neurons, s.meft_top_k, s.fsdp_version, s.sequence_parallel, s.context_parallel,
            s.activation_offload, s.tiled_mlp, s.gradient_checkpointing if s.activation_offload != "none" else None,
            s.seq_len if s.sequence_parallel > 1 or s.context_parallel > 1 else None,
            s.seq_len if model is not None and context.positions(model).kind == "learned" else None)


def _rank_key(est: Any) -> tuple:
    """Fastest first; at equal speed the standard loss (the chunked one costs the same time, so it is a
    memory lever: chosen when it makes a combination fit or a faster one possible, not for memory that is
    not needed), then the one holding less memory per node (its GPUs + its CPU RAM)."""
    return (est.step_seconds, getattr(est.strategy, "loss", "standard") != "standard",
            est.gpu_total * est.hardware.gpus_per_node + est.cpu_total, est.gpu_total)


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
    rule_memo: Optional[dict] = None,
    long_context: bool = True,
    phases: Any = None,
) -> Plan:
    """Search the levers for ``model`` on ``hardware``; recommend the fastest combination that fits.

    ``rule_memo``: a dict to reuse rule verdicts across calls for the SAME model and hardware (the matrix
    passes one per model and pool; rules do not read lengths, batch or checkpointing). ``long_context``: where
    nothing fits as is, search again with the long-context levers (memfit.plan.longctx).
    """
    from memfit.estimate import estimate

    check_margin(margin)
    result = Plan(model=model, hardware=hardware, margin=margin)
    result.search_args = dict(methods=methods, zero_stages=zero_stages, allow_offload=allow_offload,
                              offloads=offloads, seq_len=seq_len, micro_batch_size=micro_batch_size,
                              grad_accum=grad_accum, margin=margin, profile=profile, fixed=fixed, phases=phases)
    if rule_memo is None:
        rule_memo = {}

    def attempt(strategy: Strategy) -> None:
        key = rule_key(strategy, model)
        reasons = rule_memo.get(key)
        if reasons is None:
            reasons = rule_memo[key] = rules.check(model, hardware, strategy)
        if reasons:
            result.rejected.append(Rejection(strategy, " Also: ".join(reasons), "rule", reasons=reasons))
            return
        est = estimate(model, hardware, strategy, profile=profile, margin=margin, phases=phases)
        verdict = memory_verdict(est, hardware)
        if verdict is None:
            result.candidates.append(est)
        else:
            reason, short, ratio = verdict
            result.rejected.append(Rejection(strategy, reason, "memory", est, short_bytes=short, over_ratio=ratio))

    space = tuple(enumerate_strategies(
        model, hardware, methods=methods, zero_stages=zero_stages, allow_offload=allow_offload,
        offloads=offloads, seq_len=seq_len, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
        fixed=fixed,
    ))
    tried = len(space)
    for strategy in space:
        attempt(strategy)
    if long_context and not result.candidates:  # nothing fits as is: again with the long-context levers
        for strategy in long_context_variants(space, hardware, fixed):
            attempt(strategy)
    if not tried:
        make_strategy(**(fixed or {}))  # raises the validator's own message when the fixed keys contradict
        raise ConfigError("the fixed strategy keys leave no combination to try (e.g. offload needs "
                          "zero_stage>=1 or fsdp); loosen --method/--zero/--fsdp/--offload")
    result.candidates.sort(key=_rank_key)
    result.recommended = result.candidates[0] if result.candidates else None
    if explain:
        result.why = explain_plan(result)
    return result


def _twins(a: Strategy, b: Strategy) -> bool:
    """Same combination but for the loss."""
    return (a.method, a.engine, a.offload, a.gradient_checkpointing, a.attention, a.sequence_parallel,
            a.context_parallel, a.activation_offload, a.tiled_mlp) == \
        (b.method, b.engine, b.offload, b.gradient_checkpointing, b.attention, b.sequence_parallel,
         b.context_parallel, b.activation_offload, b.tiled_mlp)


def chunked_loss_note(p: Plan) -> Optional[str]:
    """When the recommendation uses the chunked loss: what the same combination needs with the standard one."""
    rec = p.recommended
    if rec is None or rec.strategy.loss != "chunked":
        return None
    twin = next((r for r in p.rejected if r.kind == "memory" and r.estimate is not None
                 and r.strategy.loss == "standard" and _twins(r.strategy, rec.strategy)), None)
    if twin is None:
        return None
    std, chk = twin.estimate, rec
    pct = _pct(chk.step_seconds, std.step_seconds)
    cost = "at the same step time" if pct in ("+0%", "-0%") else f"for {pct} step time"
    return (f"The chunked cross-entropy (--loss chunked) is what makes it fit: with the standard loss the same "
            f"combination {short_reason(std, p.hardware)}; chunking the output layer takes its logits from "
            f"{_gb(std.gpu['logits'])} to {_gb(chk.gpu['logits'])} {cost} (its gradients computed chunk by chunk in "
            "the forward, nothing recomputed).")


def _recipe(s: Strategy) -> tuple:
    """What makes two candidates different enough to both be worth a sentence."""
    return (s.method, s.engine, s.gradient_checkpointing)


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.0f}%" if b else "n/a"


def explain_plan(p: Plan) -> list[str]:
    """Sentences: what was chosen and why, what the runner-ups cost, what did not fit and by how much."""
    why: list[str] = []
    rec = p.recommended
    n_tried = len(p.candidates) + len(p.rejected)
    n_rule = sum(1 for r in p.rejected if r.kind == "rule")
    n_mem = len(p.rejected) - n_rule
    gpu_cap = float(p.hardware.gpu.memory_bytes)
    if rec is not None:
        why.append(
            f"{rec.strategy.label()} is the fastest of the {len(p.candidates)} combinations that fit "
            f"({n_tried} tried): {_sec(rec.step_seconds)} s/step using "
            f"{_gb(ram_need(rec, p.hardware) if p.hardware.gpu.is_cpu else rec.gpu_needed)} of "
            f"{_gb(gpu_cap)} {'of RAM' if p.hardware.gpu.is_cpu else 'per GPU'} with {p.margin:.0%} kept free."
        )
        for note in (lever_note(p), chunked_loss_note(p)):
            if note:
                why.append(note)
        seen = {_recipe(rec.strategy)}
        for c in p.candidates[1:]:
            if len(seen) >= 4:
                break
            if _recipe(c.strategy) in seen:
                continue
            seen.add(_recipe(c.strategy))
            why.append(f"Runner-up {c.strategy.label()}: {_sec(c.step_seconds)} s/step "
                       f"({_pct(c.step_seconds, rec.step_seconds)}), {_memory(c, p.hardware)}.")
        shown = [rec] + [c for c in p.candidates[1:] if _recipe(c.strategy) in seen]
        for method in dict.fromkeys(c.strategy.method for c in shown):  # each listed method's own note, once
            note = METHODS[method].plan_note(next(c for c in shown if c.strategy.method == method)) \
                if method in METHODS else ""
            if note:
                why.append(note)
        # per (method, checkpointing): the faster combination that came closest to fitting
        nearest: dict[tuple, Rejection] = {}
        for r in p.rejected:
            if r.kind == "memory" and r.estimate is not None and r.estimate.step_seconds < rec.step_seconds:
                key = (r.strategy.method, r.strategy.gradient_checkpointing)
                if key not in nearest or r.over_ratio < nearest[key].over_ratio:
                    nearest[key] = r
        for r in sorted(nearest.values(), key=lambda r: r.estimate.step_seconds)[:3]:
            why.append(f"Faster but does not fit: {r.strategy.label()} "
                       f"({_sec(r.estimate.step_seconds)} s/step, {_pct(r.estimate.step_seconds, rec.step_seconds)}) "
                       f"{short_reason(r.estimate, p.hardware)}.")
    else:
        why.append(f"Nothing fits: {n_mem} of {n_tried} combinations exceed memory, {n_rule} cannot run here.")
        close = p.closest
        if close is not None:
            why.append(f"Closest: {close.strategy.label()} {short_reason(close.estimate, p.hardware)}.")
            why.extend(what_would_fit(p, close))
    if n_rule:
        groups = Counter(r.reasons[0] for r in p.rejected if r.kind == "rule")
        for reason, count in groups.most_common(2):
            why.append(f"Ruled out ({count} combinations): {reason}")
    long = context.note(p.model, p.search_args.get("seq_len", 0))  # RoPE past its trained length
    return why + ([long] if long else [])


def bigger_pools(hardware: Any) -> list[Any]:
    """Larger pools of the same GPU, smallest first: more GPUs in the node (up to 8), then more nodes."""
    if hardware.gpu.is_cpu:
        return []
    pools, k = [], hardware.gpus_per_node
    for more in (2, 4, 8):
        if more > k:
            pools.append(hardware.with_gpus_per_node(more))
    base = pools[-1] if pools else hardware
    pools += [base.with_nodes(n) for n in (2, 4) if n > base.nodes]
    return pools


def what_would_fit(p: Plan, close: Rejection) -> list[str]:
    """Concrete changes that would let something fit: a bigger pool (searched), more memory per GPU,
    more CPU RAM."""
    hints = []
    est, margin = close.estimate, p.margin
    if est is None:
        return hints
    if p.hardware.gpu.is_cpu:
        need = ram_need(est, p.hardware) / (1 - margin)
        return [f"It would fit in {_gb(need)} of RAM, or with a shorter --seq-len or a smaller model."]
    if p.search_args:
        for pool in bigger_pools(p.hardware):
            found = plan(p.model, pool, explain=False, **p.search_args)
            if found.recommended is not None:
                hints.append(f"On {pool.text()} it would fit: {found.recommended.strategy.label()} "
                             f"at {_sec(found.recommended.step_seconds)} s/step.")
                break
        else:
            hints.append("No pool of up to 4 nodes of 8 of these GPUs fits it; use larger GPUs, "
                         "a shorter --seq-len or a smaller model.")
    if est.gpu_needed > est.usable_gpu_bytes:  # the estimator's margin check
        hints.append(f"{close.strategy.label()} itself would fit on GPUs with at least "
                     f"{_gb(est.gpu_needed / (1 - margin))} each.")
    ram = float(p.hardware.cpu_ram_bytes)
    if ram and est.cpu_total > ram:
        hints.append(f"It needs --cpu-ram of at least {_gb(est.cpu_total)} per node.")
    return hints
