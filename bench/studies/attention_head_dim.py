"""Attention forward + backward on one CPU thread at the same FLOPs and three head dims: why the time model
takes seconds per score = a + b·d from two head dims (docs/time.md, "attention"), for SDPA and for eager
attention's two batched products (q·kᵀ, p·v).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/attention_head_dim.py      # ~15 s

Prints per kernel and sequence length the median of 7 calls at (heads 4, d 32), (8, 16) and (2, 64), b = 1
(SDPA causal), and the d = 64 figure predicted by the line through the other two. Then SDPA (h 8, d 16)
across sequence lengths: GFLOP/s by the s² count and per score torch's CPU flash kernel computes
(memfit.steptime.speeds.cpu_flash_work: whole 512-key blocks), which stays flat from 192 tokens on.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from memfit.steptime.cpu import cpu_flash_work


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.matmul(torch.matmul(q, k.transpose(-1, -2)), v)


def seconds(fn: Callable, b: int, h: int, s: int, d: int, reps: int = 7) -> float:
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, d)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(q, k, v).backward(g)
        q.grad = k.grad = v.grad = None
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def main() -> None:
    torch.set_num_threads(1)
    for name, fn in (("SDPA", sdpa), ("eager products", products)):
        print(f"{name}\n  seq   d32 ms   d16 ms  (x d32)   d64 ms  (x d32)  d64 predicted ms")
        for s in (128, 256, 512, 1024):
            t32, t16, t64 = seconds(fn, 1, 4, s, 32), seconds(fn, 1, 8, s, 16), seconds(fn, 1, 2, s, 64)
            per32, per16 = t32 / (4 * s * s), t16 / (8 * s * s)  # seconds per score
            pred64 = (per32 + (per32 - per16) / 16 * 32) * 2 * s * s
            print(f"{s:5d} {t32 * 1e3:8.2f} {t16 * 1e3:8.2f}  ({t16 / t32:4.2f}) {t64 * 1e3:8.2f}  "
                  f"({t64 / t32:4.2f})  {pred64 * 1e3:8.2f}")
    print("SDPA h 8, d 16 across lengths\n  seq  work  GFLOP/s by s²  per computed score")
    for s in (128, 160, 190, 192, 256, 384, 512, 768, 1024):
        rate = 12 * 8 * s * s * 16 / seconds(sdpa, 1, 8, s, 16) / 1e9
        print(f"{s:5d}  {cpu_flash_work(s):4.2f}  {rate:13.1f}  {rate * cpu_flash_work(s):18.1f}")


if __name__ == "__main__":
    main()
