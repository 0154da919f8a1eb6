"""Attention's time on a GPU by sequence length and head dim.

* **Fused** (SDPA's flash backend, FlashAttention-2): causal kernels compute the lower triangle, half of the
  12·b·H·s²·d FLOPs memfit counts for forward + backward. Their rate grows with the sequence and saturates:
  ``attention_max`` x s / (s + ``attention_half_seq``) of the peak, times the share of the SMs its thread
  blocks (one per 128 query rows per head and sequence) keep busy over their waves. Through the FA2 paper's
  A100 forward + backward curve (arXiv 2307.08691, Fig. 6, causal, d = 128, 16k tokens per batch: ~100,
  ~130, ~155, ~170, ~180 TFLOP/s at 512, 1k, 2k, 4k, 8k) with 0.6 and 400 (tests/steptime/test_steptime.py).
  Head dim 64 runs ~15 % slower per FLOP than 128 in the same figures. Parts without FlashAttention-2
  (Volta, Turing) run SDPA's memory-efficient kernel at ``mem_efficient_attention_fraction`` of that rate.
* **Eager** (transformers' eager_attention_forward): the two batched products q·kᵀ and p·v as GEMMs, over the
  full square (no causal skipping), and the b·H·s² scores through memory: scale, mask, fp32 softmax, cast,
  and their gradients at ``eager_score_bytes`` per score (forward + backward).
"""

from __future__ import annotations

import math

from memfit.steptime.gemm import gemm_seconds
from memfit.steptime.rates import GpuRates

CAUSAL_WORK = 0.5
FA_BLOCK_ROWS = 128


def fused_rate(b: float, heads: float, s: float, d: float, g: GpuRates, package: bool = False) -> float:
    """FLOP/s (of memfit's full-square count 12·b·H·s²·d) of a causal fused attention, forward + backward
    (``package``: the flash-attn 2 package's kernel, else SDPA's)."""
    eff = (g.package_attention_max if package else g.attention_max) * s / (s + g.attention_half_seq)
    if d < 128:
        eff *= 1.0 - 0.15 * min(1.0, math.log2(128.0 / max(d, 1.0)))
    blocks = b * heads * math.ceil(s / FA_BLOCK_ROWS)
    waves = math.ceil(blocks / g.sms)
    eff *= blocks / (waves * g.sms)
    return g.peak * eff / CAUSAL_WORK


def fused_seconds(b: float, heads: float, s: float, d: float, g: GpuRates, mem_efficient_fraction: float,
                  package: bool = False) -> float:
    """Seconds of a causal fused attention's forward + backward over b sequences of s tokens."""
    rate = fused_rate(b, heads, s, d, g, package) * (1.0 if g.fused_attention else mem_efficient_fraction)
    return 12.0 * b * heads * s * s * d / rate


def eager_seconds(b: float, heads: float, s: float, d: float, g: GpuRates, e: float,
                  score_bytes: float) -> tuple[float, float]:
    """(products, scores) seconds of eager attention's forward + backward: 6 batched GEMMs of s x s x d
    (forward q·kᵀ, p·v; backward two gradients each) and the scores' memory-bound passes."""
    bh = b * heads
    products = 2.0 * gemm_seconds(bh * s, s, d, g, e) + 4.0 * gemm_seconds(bh * s, d, s, g, e)
    scores = bh * s * s
    return products, scores * score_bytes / g.bandwidth(scores * e)
