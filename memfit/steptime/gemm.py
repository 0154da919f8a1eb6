"""A GEMM's time on a GPU by its shape: (M x K) . (K x N), ``e`` bytes per value.

time = max(FLOPs at the tile-occupancy rate, bytes at the achieved bandwidth) + a fixed kernel time.

* The rate: the GPU's best achievable matmul rate (GpuRates.matmul_max x peak) times the share of the
  streaming multiprocessors the output tiles keep busy over their waves (NVIDIA's "Matrix Multiplication
  Background" guide §3.1-3.2, tile and wave quantisation): tiles = ceil(M / tm) x ceil(N / tn), waves =
  ceil(tiles / SMs), occupancy = tiles / (waves x SMs). cuBLAS picks among tile shapes; the better of a
  128 x 128 tile and a 64 x 128 one (at ``small_tile_efficiency`` of its rate) is taken, and when the tiles
  fill less than one wave and K >= 4096 the K loop is split (split-K) up to that wave's worth of blocks.
* The bytes: A, B read once, C written once (a roofline bound; LoRA's rank-r products land here).
* The fixed time: launch latency, ramp-up and tail of one kernel (XLA's measured H100 table,
  matmul_interpolator_data.h: 256x2048x256 ran 6.4 us, 512x256x256 5.8 us).

Checked against XLA's H100 table (bf16, TFLOP/s, measured / here with 5 us and 0.8): 4096³ 783 / 746;
2048³ 632 / 627; 1024x2048x2048 524 / 530; 1024x1024x2048 350 / 357; 256x2048x4096 286 / 350;
256x2048x256 42 / 41; 512x256x256 11.5 / 11 (tests/steptime/test_steptime.py).
"""

from __future__ import annotations

import math

from memfit.steptime.rates import GpuRates

TILES = ((128, 128, 1.0), (64, 128, None))  # (rows, cols, relative rate; None: GpuRates.small_tile_efficiency)


def occupancy(m: float, n: float, k: float, sms: int, small_tile: float) -> float:
    """Share of the peak matmul rate the tiles of an (m x k)(k x n) product keep busy (see the module doc)."""
    best = 0.0
    for tm, tn, rel in TILES:
        rel = small_tile if rel is None else rel
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        if tiles < sms and k >= 4096:  # split-K: the K loop in up to sms // tiles slices of >= 1024
            tiles *= max(1, min(sms // tiles, int(k // 1024)))
        waves = math.ceil(tiles / sms)
        best = max(best, rel * tiles / (waves * sms))
    return best


def gemm_seconds(m: float, n: float, k: float, g: GpuRates, e: float = 2.0, fp32: bool = False) -> float:
    """Seconds of one (m x k)(k x n) GEMM with ``e``-byte values; ``fp32``: plain fp32 (no tensor cores)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    peak = (g.fp32_peak if fp32 else g.peak) * g.matmul_max
    compute = 2.0 * m * n * k / (peak * occupancy(m, n, k, g.sms, g.small_tile_efficiency))
    nbytes = e * (m * k + k * n + m * n)
    return max(compute, nbytes / g.bandwidth(nbytes)) + g.gemm_kernel_seconds


def linear_seconds(tokens: float, k: float, n: float, g: GpuRates, weight_grad: bool, e: float = 2.0,
                   fp32: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of a linear k -> n over ``tokens`` rows: the forward GEMM; the input
    gradient (tokens x n)(n x k), and with ``weight_grad`` the weight gradient (k x tokens)(tokens x n)."""
    fwd = gemm_seconds(tokens, n, k, g, e, fp32)
    bwd = gemm_seconds(tokens, k, n, g, e, fp32) + (gemm_seconds(k, n, tokens, g, e, fp32) if weight_grad else 0.0)
    return fwd, bwd
