"""How much slower one-thread work runs in each of two processes side by side, second by second: why the
calibration's ``concurrency`` figure is merged by its mean (memfit.spec.hwprofile.MEAN_FIGURES).

    PYTHONPATH=. .venv/bin/python bench/studies/concurrency_series.py  # 60 x (0.5 s alone + 0.5 s together), ~65 s
    PYTHONPATH=. .venv/bin/python bench/studies/concurrency_series.py --cycles 120 --seconds 0.25

Two forked processes, one thread each, run the calibration's GEMM (512 × 384 · 384 × 384, forward + backward):
per cycle process 0 runs it alone for ``--seconds`` while process 1 sleeps, then both run it; the line shows
the two medians and their ratio. On this 2-vCPU VM the ratio sits at 1.0 and, for a few seconds at a time,
at ~1.9-2.0 (the host running both vCPUs on one core); the mean over the cycles is what a run meets.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


def _worker(rank: int, queue, barrier, seconds: float, cycles: int) -> None:
    import torch

    from memfit.measure.collective_bench import concurrency_gemm

    torch.set_num_threads(1)
    gemm = concurrency_gemm()

    def median_for(sec: float) -> float:
        times, end = [], time.perf_counter() + sec
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            gemm()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for _ in range(10):
        gemm()
    start = time.time()
    for _ in range(cycles):
        barrier.wait()
        alone = median_for(seconds) if rank == 0 else time.sleep(seconds)
        barrier.wait()
        both = median_for(seconds)
        if rank == 0:
            queue.put((time.time() - start, alone, both))
    if rank == 0:
        queue.put(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=60)
    ap.add_argument("--seconds", type=float, default=0.5, help="each half of a cycle")
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    queue, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_worker, args=(r, queue, barrier, args.seconds, args.cycles)) for r in range(2)]
    for p in procs:
        p.start()
    ratios = []
    print("     t   alone ms   both ms  ratio")
    while (item := queue.get()) is not None:
        at, alone, both = item
        ratios.append(both / alone)
        print(f"{at:6.1f}  {alone * 1e3:9.2f} {both * 1e3:9.2f}  {ratios[-1]:5.2f}", flush=True)
    for p in procs:
        p.join()
    slow = sum(r > 1.5 for r in ratios)
    print(f"ratio: mean {statistics.mean(ratios):.3f}, median {statistics.median(ratios):.3f}; "
          f"{slow} of {len(ratios)} cycles over 1.5x")


if __name__ == "__main__":
    main()
