"""Plan a fixed number of sequences per optimizer step: the planner also picks micro-batch × accumulation.

``plan_batch(model, hw, seq_len=..., sequences=8)`` runs :func:`memfit.plan.search.plan` once per
micro-batch that divides ``sequences`` (accumulation = sequences / micro-batch, so every option trains
the same tokens per step) and returns the plan whose recommendation has the most tokens/s; its
``candidates`` are every option's fitting combinations, fastest first.
"""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError


def micro_batches(sequences: int) -> list[int]:
    """Micro-batch sizes dividing ``sequences`` (1, 2, 4, ... and ``sequences`` itself)."""
    if sequences < 1:
        raise ConfigError(f"sequences per step {sequences}: must be a positive integer, e.g. 8")
    return [b for b in range(1, sequences + 1) if sequences % b == 0]


def plan_batch(model: Any, hardware: Any, *, seq_len: int, sequences: int, **kw: Any) -> Any:
    """The fastest plan over micro-batch sizes at ``sequences`` per optimizer step (per process)."""
    from memfit.plan.search import plan

    plans = [plan(model, hardware, seq_len=seq_len, micro_batch_size=b, grad_accum=sequences // b, **kw)
             for b in micro_batches(sequences)]
    fitting = [p for p in plans if p.recommended is not None]
    if not fitting:
        return plans[0]
    best = max(fitting, key=lambda p: p.recommended.tokens_per_second)
    best.candidates = sorted((c for p in plans for c in p.candidates), key=lambda c: c.step_seconds)
    rec = best.recommended.strategy
    best.why.insert(0, f"{sequences} sequences per step as micro-batch {rec.micro_batch_size} x accumulation "
                       f"{rec.grad_accum}: the most tokens/s of {len(fitting)} micro-batch sizes that fit "
                       f"({', '.join(str(p.recommended.strategy.micro_batch_size) for p in fitting)})")
    return best
