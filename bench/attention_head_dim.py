"""SDPA forward + backward on one CPU thread at the same FLOPs and three head dims: why the time model
takes seconds per score = a + b·d from two head dims (docs/time.md, "attention").

    OMP_NUM_THREADS=1 .venv/bin/python bench/attention_head_dim.py      # ~10 s

Prints per sequence length the median of 7 calls at (heads 4, d 32), (8, 16) and (2, 64), b = 1, causal,
and the d = 64 figure predicted by the line through the other two.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def seconds(b: int, h: int, s: int, d: int, reps: int = 7) -> float:
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, d)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        q.grad = k.grad = v.grad = None
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def main() -> None:
    torch.set_num_threads(1)
    print("  seq   d32 ms   d16 ms  (x d32)   d64 ms  (x d32)  d64 predicted ms")
    for s in (128, 256, 512, 1024):
        t32, t16, t64 = seconds(1, 4, s, 32), seconds(1, 8, s, 16), seconds(1, 2, s, 64)
        per32, per16 = t32 / (4 * s * s), t16 / (8 * s * s)  # seconds per score
        pred64 = (per32 + (per32 - per16) / 16 * 32) * 2 * s * s
        print(f"{s:5d} {t32 * 1e3:8.2f} {t16 * 1e3:8.2f}  ({t16 / t32:4.2f}) {t64 * 1e3:8.2f}  ({t64 / t32:4.2f})"
              f"  {pred64 * 1e3:8.2f}")


if __name__ == "__main__":
    main()
