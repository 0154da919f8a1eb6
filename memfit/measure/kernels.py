"""The micro-benchmarks of ``memfit calibrate --hardware`` (memfit.measure.hwcal runs them): each times, a
few repetitions under a time cap, one part of what a training step spends its time on.

* **GEMM** — ``F.linear`` forward + backward (input and weight gradients: 6·m·k·n FLOPs) at the dtypes
  training uses and the shape classes the time model interpolates (small / medium / large width, LoRA's
  rank-16 products);
* **attention** — SDPA (``is_causal``) forward + backward and its forward alone; transformers' eager path
  in two parts (its batched products; its work on the score matrix by size, page faults kept apart);
* **bandwidth** — a memory-bound elementwise op; the first touch of a fresh (mmapped) tensor; dropout's
  random mask (CPU); the dispatch cost of one small op and of transformers' Llama layers / PEFT adapters;
* **optimizer** — ``torch.optim.AdamW`` (the HF Trainer's ``adamw_torch``) by tensor size and per tensor;
  DeepSpeed's CPU Adam where its extension is already built;
* where present: pinned host↔device copies; bitsandbytes' kernels and transformers' / PEFT's own dispatch
  cost are in :mod:`memfit.measure.overheads`.

On CUDA every figure is timed with ``torch.cuda.Event``; on CPU with ``time.perf_counter`` (all cores)
or the thread's CPU time (one thread: a shared machine's other processes then cost less).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from memfit.steptime.cpu import GLIBC_MMAP_THRESHOLD_MAX
from memfit.steptime.speeds import log_interp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Timer:
    """Best-of-N timing of ``fn`` on ``device``, within ``cap`` seconds (at least ``min_reps``)."""

    def __init__(self, device: str, one_thread: bool = False) -> None:
        self.device, self.one_thread = device, one_thread

    def __call__(self, fn: Callable[[], None], reps: int = 9, cap: float = 0.25, min_reps: int = 3,
                 warmup: bool = True) -> float:
        """The median of the repetitions: what a training step meets (the best of a few on a shared
        machine drifts by ±25 % between calibrations; the median of more, shorter ones far less).
        ``warmup=False`` where every call starts cold anyway (fresh mmapped tensors each time)."""
        if warmup:
            fn()  # allocations, kernel selection
        times, start = [], time.perf_counter()
        for i in range(reps):
            times.append(self._once(fn))
            if i + 1 >= min_reps and time.perf_counter() - start > cap:
                break
        times.sort()
        return times[len(times) // 2]

    def interleaved(self, fns: dict, rounds: int = 9) -> dict:
        """The median time of each of ``fns``, timed round-robin (one repetition of each per round): figures
        meant to be subtracted from one another then see the same moments of a shared machine."""
        for fn in fns.values():
            fn()
        times: dict = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                times[k].append(self._once(fn))
        return {k: sorted(v)[len(v) // 2] for k, v in times.items()}

    def _once(self, fn: Callable[[], None]) -> float:
        if self.device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        clock = time.thread_time if self.one_thread else time.perf_counter
        t0 = clock()
        fn()
        return clock() - t0


def _gemm_shapes(device: str) -> dict[str, tuple[int, int, int]]:
    """class -> (m tokens, k in, n out). The time model interpolates in log(sqrt(k·n)) through the
    small, medium and large widths; skinny is the mean rate of LoRA's two rank-16 products
    (x·A: k -> 16, then B: 16 -> n)."""
    if device == "cuda":
        return {"small": (4096, 512, 512), "medium": (8192, 1536, 1536), "large": (8192, 4096, 4096),
                "skinny": (8192, 4096, 16), "skinny_b": (8192, 16, 4096)}
    # CPU: a typical micro-batch's rows (b·s ~ 1024 tokens); 2048 x 128 left a 1 MB L2 (docs/time.md)
    return {"small": (1024, 128, 128), "medium": (1024, 384, 384), "large": (512, 1024, 1024),
            "skinny": (1024, 256, 16), "skinny_b": (1024, 16, 256)}


def gemm_rates(device: str, dtypes: list[str], timer: Timer) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in dtypes:
        dt = DTYPES[name]
        out[name] = {}
        for cls, (m, k, n) in _gemm_shapes(device).items():
            reps, cap = 9, 0.4
            if device == "cpu" and name != "fp32":  # CPU bf16 GEMMs run ~10-30x slower: fewer rows, reps
                m, reps, cap = max(16, m // 32), 5, 0.15
            x = torch.randn(m, k, device=device, dtype=dt, requires_grad=True)
            w = torch.randn(n, k, device=device, dtype=dt, requires_grad=True)
            g = torch.randn(m, n, device=device, dtype=dt)

            def step() -> None:
                F.linear(x, w).backward(g)
                x.grad = w.grad = None
            out[name][cls] = 6.0 * m * k * n / timer(step, reps=reps, cap=cap)
        # LoRA runs both products: x·A (k -> r) and (x·A)·B (r -> n, ~10-20 % slower here): their mean rate
        out[name]["skinny"] = 2.0 / (1.0 / out[name]["skinny"] + 1.0 / out[name].pop("skinny_b"))
        out[name]["widths"] = {c: (k * n) ** 0.5 for c, (m, k, n) in _gemm_shapes(device).items()
                               if not c.startswith("skinny")}
    return out


def _sdpa_seconds(b: int, h: int, s: int, d: int, device: str, dt: torch.dtype, timer: Timer):
    """(seconds of a causal SDPA forward + backward at (b, h, s, d), the forward alone as a callable)."""
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, d, device=device, dtype=dt)

    def fn() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def step() -> None:
        fn().backward(g)
        q.grad = k.grad = v.grad = None
    return timer(step, reps=3), fn


def attention_rates(device: str, dtypes: list[str], timer: Timer, first_touch: float = 0.0) -> dict[str, dict]:
    """kind -> dtype -> {seq: FLOP/s}: at a short and a long sequence (the s² scores leave the caches) and, on
    a CPU, at 128 (torch's flash kernel takes 32-row query blocks below 192 tokens: memfit.steptime.speeds).
    SDPA is timed there (and its forward alone: what checkpointing's recomputation adds); eager is timed
    in its two parts (:func:`eager_parts`) and its curve at those lengths follows from them."""
    b, h, d, lengths = (2, 16, 128, (1024, 4096)) if device == "cuda" else (1, 4, 32, (128, 256, 1024))
    out: dict[str, dict] = {"eager": {}, "sdpa": {}, "shape": [b, h, list(lengths), d]}
    if device == "cpu":  # and at half the head dim (twice the heads: the same FLOPs, twice the scores)
        out["sdpa_half_d"] = {}
    shares = []
    for name in dtypes:
        dt = DTYPES[name]
        out["sdpa"][name] = {}
        for s in lengths:
            both, fn = _sdpa_seconds(b, h, s, d, device, dt, timer)
            out["sdpa"][name][str(s)] = 12.0 * b * h * s * s * d / both
            if s == lengths[-1]:
                shares.append(min(1.0, timer(fn, reps=3) / both))
            if "sdpa_half_d" in out:  # the fused kernel's per-score work does not shrink with d (docs/time.md)
                half, _ = _sdpa_seconds(b, 2 * h, s, d // 2, device, dt, timer)
                out["sdpa_half_d"].setdefault(name, {})[str(s)] = 12.0 * b * h * s * s * d / half
    out["eager_parts"] = {name: eager_parts(device, name, timer, first_touch) for name in dtypes}
    for name, parts in out["eager_parts"].items():
        size = torch.tensor([], dtype=DTYPES[name]).element_size()
        scores = sorted((float(k), t) for k, t in parts["scores"].items())
        out["eager"][name] = {str(s): 12.0 * d / (12.0 * d / parts["bmm"] + log_interp(scores, b * h * s * s * size))
                              for s in lengths}  # FLOP/s = 12·b·h·s²·d / (products + b·h·s² score values)
    out["forward_share"] = {"sdpa": sorted(shares)[len(shares) // 2]}
    return out


def eager_parts(device: str, dtype: str, timer: Timer, first_touch: float = 0.0) -> dict:
    """transformers' eager attention in its two parts, forward + backward:

    * ``bmm`` — FLOP/s of its two batched products (q·kᵀ, p·v: 12·b·H·s²·d with their gradients); on a CPU
      also ``bmm_half_d`` at half the head dim with twice the heads (the same FLOPs, twice the scores), from
      which Speeds.eager_bmm_rate takes the model's head dim;
    * ``scores`` — seconds per score value of the work on the b·H·s² matrix itself (scale, mask add,
      fp32 softmax, and their gradients), by the matrix's bytes: it runs from L2, L3 or memory as the matrix
      grows (CPU: 1 MB fits L2, 16 MB the L3, 32 MB with its gradient neither); ``scores_forward_share``: the
      forward's part (what checkpointing recomputes).
    """
    dt = DTYPES[dtype]
    size = torch.tensor([], dtype=dt).element_size()
    b, h, s, d = (2, 16, 2048, 128) if device == "cuda" else (1, 8, 256, 32)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, d, device=device, dtype=dt)

    def products_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
        def products() -> None:
            torch.matmul(torch.matmul(q, k.transpose(-1, -2)), v).backward(g)
            q.grad = k.grad = v.grad = None
        return products
    out: dict = {"bmm": 12.0 * b * h * s * s * d / timer(products_of(q, k, v, g), reps=5), "scores": {}}
    if device == "cpu":  # and at half the head dim, twice the heads (the same FLOPs): Speeds.eager_bmm_rate
        half = [torch.randn(b, 2 * h, s, d // 2, dtype=dt, requires_grad=True) for _ in range(3)]
        t = timer(products_of(*half, torch.randn(b, 2 * h, s, d // 2, dtype=dt)), reps=5)
        out["bmm_half_d"], out["bmm_head_dim"] = 12.0 * b * h * s * s * d / t, d
    shares = []
    for b, h, s in ([(2, 16, 2048), (8, 16, 2048)] if device == "cuda" else [(1, 4, 256), (1, 4, 1024), (1, 8, 1024)]):
        x = torch.randn(b, h, s, s, device=device, dtype=dt, requires_grad=True)
        mask = torch.full((s, s), float("-inf"), device=device, dtype=dt).triu(1)
        gs = torch.randn(b, h, s, s, device=device, dtype=dt)

        def forward() -> torch.Tensor:  # as eager_attention_forward: scale, mask add, fp32 softmax, cast back
            return torch.softmax(x * 0.125 + mask, dim=-1, dtype=torch.float32).to(dt)

        def both() -> None:
            forward().backward(gs)
            x.grad = None
        nbytes = b * h * s * s * size
        t = timer(both, reps=3, warmup=device != "cpu" or nbytes < GLIBC_MMAP_THRESHOLD_MAX)
        # the page faults of its five new matrices (scale, mask add, softmax; two gradients) when they are
        # above glibc's mmap threshold: counted apart by the time model (memfit.steptime.cpu)
        faults = first_touch * nbytes * 5 if nbytes >= GLIBC_MMAP_THRESHOLD_MAX else 0.0
        out["scores"][str(nbytes)] = max(t - faults, 0.5 * t) / (b * h * s * s)
        if not faults:  # the forward's share, where page faults do not blur it (and it costs least to time)
            shares.append(min(1.0, timer(forward, reps=3) / t))
    out["scores_forward_share"] = statistics.median(shares)
    return out


def bandwidth_rate(device: str, timer: Timer) -> float:
    """Bytes/s of ``torch.add(a, b, out=c)`` (3 passes). CPU: a step streams tensors written long before, so
    each add reads the next of 48 cold pairs of 2 MB tensors into one warm output; a hot 48 MB stayed in a
    480 MB L3 at 26.5 GB/s where a step's ops ran at 14-17 (docs/time.md "Bandwidth")."""
    n, k = (64 << 20, 1) if device == "cuda" else (1 << 19, 48)  # GPU: one 256 MB pair, added 4 times
    pool = [(torch.full((n,), 1.5, device=device), torch.full((n,), 0.5, device=device)) for _ in range(k)]
    c, rounds = torch.empty(n, device=device), 4 if device == "cuda" else 1

    def stream() -> None:
        for _ in range(rounds):
            for a, b in pool:
                torch.add(a, b, out=c)
    return rounds * k * 3 * 4.0 * n / timer(stream)


def first_touch_seconds_per_byte(timer: Timer) -> float:
    """CPU: seconds per byte a fresh 64 MB tensor (mmapped by glibc, zeroed page by page on first touch:
    memfit.steptime.cpu) costs over an existing one. A mapping of its own, not ``torch.empty``, which a
    long-lived process may serve from freed heap pages (the figure read ~0: docs/time.md)."""
    import mmap

    n = 16 << 20  # 64 MB of fp32
    kept = torch.empty(n)

    def fresh() -> None:
        region = mmap.mmap(-1, 4 * n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as glibc maps it
        values = torch.frombuffer(region, dtype=torch.float32)
        values.fill_(1.0)
        del values
        region.close()
    t = timer.interleaved({"fresh": fresh, "kept": lambda: kept.fill_(1.0)}, rounds=5)
    return max(0.0, t["fresh"] - t["kept"]) / (4.0 * n)


def dropout_seconds_per_value(timer: Timer) -> float:
    """CPU: seconds per value of ``F.dropout`` forward (PEFT's ``lora_dropout``): a random draw per value,
    ~4.7 ns where a product costs ~0.2 (docs/time.md "Dropout on a CPU"), not what its bytes imply."""
    x = torch.randn(512, 688)
    return timer(lambda: F.dropout(x, 0.05, training=True), reps=7) / x.numel()


def op_seconds(device: str, timer: Timer) -> float:
    """One small op forward + backward through autograd: the per-op dispatch cost."""
    x = torch.randn(64, device=device, requires_grad=True)
    ops = 200

    def step() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()
        x.grad = None
    return timer(step, reps=5) / ops


def adamw_seconds(device: str, timer: Timer) -> dict[str, float]:
    """torch.optim.AdamW (defaults, as the HF Trainer's adamw_torch): seconds per parameter and per tensor."""
    def per_step(sizes: list[int]) -> float:
        ps = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-4)
        return timer(opt.step, reps=4)
    big = (16 if device == "cuda" else 2) * (1 << 20)
    t_big = per_step([big])
    t_many = per_step([1024] * 128)
    per_tensor = max(0.0, (t_many - t_big * 128 * 1024 / big) / 128)
    # a layer-sized tensor (128k values: its p, grad and two moments, 2 MB, stay in cache across AdamW's ~10
    # passes; a 2M tensor's 32 MB do not): 4.0 vs 6.2 ns per parameter on this machine's CPU
    mid = 1 << 17
    t_mid = per_step([mid] * 16)
    return {"per_param": t_big / big, "per_tensor": per_tensor, "tensor_params": big,
            "per_param_mid": max(0.0, t_mid - 16 * per_tensor) / (16 * mid), "mid_tensor_params": mid}


def deepspeed_cpu_adam_seconds(timer: Timer) -> Optional[float]:
    """DeepSpeedCPUAdam seconds per parameter, only where its extension is already built (no 40 s build)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        built = os.path.join(_get_build_directory("cpu_adam", verbose=False), "cpu_adam.so")
        if not os.path.isfile(built):
            return None
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # deepspeed absent or its build cache unreadable: not measured
        return None
    n = 2 * (1 << 20)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([p], lr=1e-4)
    return timer(opt.step, reps=4) / n


def copy_rates(timer: Timer) -> dict[str, float]:
    """Pinned host<->device copies (CUDA only), bytes/s each way."""
    n = 64 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    return {"h2d": n / timer(lambda: dev.copy_(host, non_blocking=True)),
            "d2h": n / timer(lambda: host.copy_(dev, non_blocking=True))}
