"""Collectives for ``memfit calibrate --hardware``: all-reduce, all-gather and reduce-scatter (the tensor
forms FSDP2 and DeepSpeed use) between forked gloo processes on a CPU, or the GPUs with NCCL: bus bandwidth
and latency per primitive.

On a CPU (gloo) every figure is the **mean** time per call over a run of back-to-back calls (preemptions
over 20x the median left out), not the median: a gloo call hands its work from the caller to gloo's run-loop
thread and its TCP loop thread (in both processes), and on a machine whose cores the ranks fill, a woken thread
often waits for a core, so one call takes either ~0.5 ms or ~3-4 ms (2 cores, 256 to 176k elements: median 0.7 ms, mean
2.0 ms; docs/time.md "Sharded engines on a CPU"). A step pays the sum of its calls, i.e. the mean; the median of a few
missed the slow mode (0.85 ms against 2.8 ms per all-reduce inside a ZeRO-2 step)."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from memfit.measure.kernels import Timer


def _collective_rank(rank: int, world: int, init: str, backend: str, conn) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    big = torch.ones((64 if device == "cuda" else 4) << 18, device=device)  # 1 MiB elements on CPU
    small = torch.ones(256, device=device)

    if device == "cpu":  # the mean per call (see the module docstring); CUDA keeps the median of events
        def timer(fn: Callable[[], None], reps: int) -> float:
            return mean_call_seconds(fn, 3 * reps)
    else:
        timer = Timer(device)

    def reduce(t: torch.Tensor) -> Callable[[], None]:
        return lambda: dist.all_reduce(t)
    t_big, t_small = timer(reduce(big), reps=4), timer(reduce(small), reps=8)
    # FSDP2 and DeepSpeed's parameter gathers use the tensor forms of all-gather / reduce-scatter
    # (all_gather_single / reduce_scatter_single, all_gather_into_tensor): timed on their own
    gathered, full = torch.empty(world * big.numel(), device=device), torch.ones(world * big.numel(), device=device)
    small_out = torch.empty(world * small.numel(), device=device)
    small_in = torch.ones(world * small.numel(), device=device)
    shard, small_shard = torch.empty_like(big), torch.empty_like(small)
    ag = [timer(lambda: dist.all_gather_into_tensor(o, i), reps=r)
          for o, i, r in ((gathered, big, 4), (small_out, small, 8))]
    rs = [timer(lambda: dist.reduce_scatter_tensor(o, i), reps=r)
          for o, i, r in ((shard, full, 4), (small_shard, small_in, 8))]
    shared = concurrency(rank, dist.barrier) if device == "cpu" else None
    if rank == 0:
        wire = big.numel() * 4.0 * (world - 1) / world
        conn.send({"backend": backend, "bus_bytes_per_s": 2.0 * wire / max(t_big - t_small, 1e-9), "latency_s": t_small,
                   "all_gather": {"bus_bytes_per_s": world * wire / max(ag[0] - ag[1], 1e-9), "latency_s": ag[1]},
                   "reduce_scatter": {"bus_bytes_per_s": world * wire / max(rs[0] - rs[1], 1e-9), "latency_s": rs[1]},
                   **({"concurrency": shared} if shared else {})})
    dist.destroy_process_group()


def concurrency_gemm() -> Callable[[], None]:
    """The one-thread work :func:`concurrency` times: a 512 × 384 · 384 × 384 linear, forward + backward."""
    import torch.nn.functional as F

    x, w = torch.randn(512, 384, requires_grad=True), torch.randn(384, 384, requires_grad=True)
    g = torch.randn(512, 384)

    def gemm() -> None:
        F.linear(x, w).backward(g)
        x.grad = w.grad = None
    return gemm


def concurrency(rank: int, barrier: Callable[[], None], rounds: int = 3) -> Optional[dict[str, float]]:
    """How much slower one-thread work runs in each process when every rank runs it at once (CPU): rank 0
    times a GEMM (forward + backward) and a loop of small autograd ops alone while the others wait, then
    all ranks run them together; the mean over ``rounds`` alternations of together / alone, by kind.
    Processes on their own cores still share what the machine shares (caches, SMT siblings, a VM host's
    cores): on this 2-vCPU machine 1.0x, or ~1.9x for seconds at a time (docs/time.md); a run meets the mean
    (the profile merges calibrations by it too: memfit.spec.hwprofile.MEAN_FIGURES)."""
    gemm, small = concurrency_gemm(), torch.randn(64, requires_grad=True)

    def ops() -> None:
        y = small
        for _ in range(100):
            y = y * 1.0001
        y.sum().backward()
        small.grad = None
    timer, ratios = Timer("cpu"), {"gemm": [], "ops": []}
    for _ in range(rounds):
        barrier()
        alone = {"gemm": timer(gemm, reps=3, cap=0.03), "ops": timer(ops, reps=3, cap=0.03)} if rank == 0 else {}
        barrier()
        both = {"gemm": timer(gemm, reps=3, cap=0.03), "ops": timer(ops, reps=3, cap=0.03)}
        for k in alone:
            ratios[k].append(both[k] / alone[k])
    return {k: sum(max(1.0, r) for r in v) / len(v) for k, v in ratios.items()} if rank == 0 else None


OUTLIER = 20.0  # a call slower than this x the median is another process's preemption, left out


def mean_call_seconds(fn: Callable[[], None], reps: int) -> float:
    """Seconds per call of ``fn``: the mean of ``reps`` back-to-back calls after one warm-up, leaving out
    calls over ``OUTLIER`` x the median (a preemption by another process for tens of ms or more; the
    hand-offs' slow mode, 3-10x the median here, stays in)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    cap = OUTLIER * sorted(times)[len(times) // 2]
    kept = [t for t in times if t <= cap]
    return sum(kept) / len(kept)


def collective_rates(world: int, backend: str) -> Optional[dict[str, float]]:
    """All-reduce bus bandwidth and latency between ``world`` processes (gloo: forked from this one)."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn" if backend == "nccl" else "fork")
    init = f"file://{tempfile.mktemp(prefix='memfit-hwcal-')}"
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_collective_rank, args=(r, world, init, backend, child)) for r in range(world)]
    for p in procs:
        p.start()
    result = parent.recv() if parent.poll(120) else None
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return result
