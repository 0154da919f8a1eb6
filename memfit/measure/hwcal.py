"""``memfit calibrate --hardware``: time what a training step spends its time on, once per machine.

Micro-benchmarks, each a few repetitions under a time cap (the whole run ≤ ~20 s on a 2-core CPU):

* **GEMM** — ``F.linear`` forward + backward (input and weight gradients: 6·m·k·n FLOPs) at the dtypes
  training uses and three shape classes: square-ish at a small and a large width (interpolated in
  log-width by the time model) and skinny (one side the LoRA rank);
* **attention** — eager (matmul, fp32 softmax, matmul, as transformers' eager path) and
  ``F.scaled_dot_product_attention(is_causal=True)``, forward + backward, as FLOP/s of 12·b·H·s²·d;
* **bandwidth** — a memory-bound elementwise op (bytes read + written per second) and the dispatch cost
  of one small autograd op (forward + backward);
* **optimizer** — ``torch.optim.AdamW`` step (as the HF Trainer's ``adamw_torch``), per parameter and per
  tensor; DeepSpeed's CPU Adam where its extension is already built;
* where present: pinned host↔device copies, NF4 dequantisation (bitsandbytes), and collectives for
  the process count (gloo on CPU between forked processes, NCCL between GPUs).

On CUDA every figure is timed with ``torch.cuda.Event``; on CPU with ``time.perf_counter`` (all-core
figures) or the thread's CPU time (one-thread figures: a shared machine's other processes then cost
less), the best of the repetitions. The result is a ``memfit.spec.hwprofile.HardwareRates``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from memfit.estimate.faults import GLIBC_MMAP_THRESHOLD_MAX
from memfit.spec import hwprofile

Progress = Optional[Callable[[str], None]]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _Timer:
    """Best-of-N timing of ``fn`` on ``device``, within ``cap`` seconds (at least ``min_reps``)."""

    def __init__(self, device: str, one_thread: bool = False) -> None:
        self.device, self.one_thread = device, one_thread

    def __call__(self, fn: Callable[[], None], reps: int = 9, cap: float = 0.4, min_reps: int = 3) -> float:
        """The median of the repetitions: what a training step meets (the best of a few on a shared
        machine drifts by ±25 % between calibrations; the median of more, shorter ones far less)."""
        fn()  # warm-up (allocations, kernel selection)
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
    # CPU: the rows of a typical micro-batch (b·s ~ 1024 tokens) at each width. Not more rows at the small
    # width: 2048 x 128 fp32 (1 MB per operand) leaves the 1 MB L2 and read 37-53 GFLOP/s where the training
    # step's 1024 x 128 linears ran at 60-63 (this machine, /work/scratch/gemm.py in the session log).
    return {"small": (1024, 128, 128), "medium": (1024, 384, 384), "large": (512, 1024, 1024),
            "skinny": (1024, 256, 16), "skinny_b": (1024, 16, 256)}


def gemm_rates(device: str, dtypes: list[str], timer: _Timer) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in dtypes:
        dt = DTYPES[name]
        out[name] = {}
        for cls, (m, k, n) in _gemm_shapes(device).items():
            if device == "cpu" and name != "fp32":  # CPU bf16 GEMMs run ~10-30x slower: fewer rows
                m = max(64, m // 8)
            x = torch.randn(m, k, device=device, dtype=dt, requires_grad=True)
            w = torch.randn(n, k, device=device, dtype=dt, requires_grad=True)
            g = torch.randn(m, n, device=device, dtype=dt)

            def step() -> None:
                F.linear(x, w).backward(g)
                x.grad = w.grad = None
            out[name][cls] = 6.0 * m * k * n / timer(step)
        # LoRA runs both products: x·A (k -> r) and (x·A)·B (r -> n, ~10-20 % slower here): their mean rate
        out[name]["skinny"] = 2.0 / (1.0 / out[name]["skinny"] + 1.0 / out[name].pop("skinny_b"))
        out[name]["widths"] = {c: (k * n) ** 0.5 for c, (m, k, n) in _gemm_shapes(device).items()
                               if not c.startswith("skinny")}
    return out


def _eager_attention(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5) + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def attention_rates(device: str, dtypes: list[str], timer: _Timer, first_touch: float = 0.0) -> dict[str, dict]:
    """kind -> dtype -> {seq: FLOP/s}: at a short and a long sequence (the s² scores leave the caches)."""
    b, h, d, lengths = (2, 16, 128, (1024, 4096)) if device == "cuda" else (1, 4, 32, (256, 1024))
    out: dict[str, dict] = {"eager": {}, "sdpa": {}, "shape": [b, h, list(lengths), d]}
    shares: dict[str, list] = {}
    for name in dtypes:
        dt = DTYPES[name]
        for kind in ("eager", "sdpa"):
            out[kind][name] = {}
        for s in lengths:
            q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
            mask = torch.full((s, s), float("-inf"), device=device, dtype=dt).triu(1)
            g = torch.randn(b, h, s, d, device=device, dtype=dt)
            flops = 12.0 * b * h * s * s * d
            for kind, fn in (("eager", lambda: _eager_attention(q, k, v, mask)),
                             ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
                def step(fn=fn) -> None:
                    fn().backward(g)
                    q.grad = k.grad = v.grad = None
                both = timer(step, reps=3)
                out[kind][name][str(s)] = flops / both
                if s == lengths[-1]:  # what checkpointing's recomputation adds: the forward's share of the step
                    shares.setdefault(kind, []).append(min(1.0, timer(fn, reps=3) / both))
    out["eager_parts"] = {name: eager_parts(device, name, timer, first_touch) for name in dtypes}
    out["forward_share"] = {kind: sorted(v)[len(v) // 2] for kind, v in shares.items()}
    return out


def eager_parts(device: str, dtype: str, timer: _Timer, first_touch: float = 0.0) -> dict:
    """transformers' eager attention in its two parts, forward + backward:

    * ``bmm`` — FLOP/s of its two batched products (q·kᵀ, p·v: 12·b·H·s²·d with their gradients);
    * ``scores`` — seconds per score value of the work on the b·H·s² matrix itself (scale, mask add,
      fp32 softmax, and their gradients), by the matrix's bytes: it runs from L2, L3 or memory as the matrix
      grows (CPU: 1 MB fits L2, 16 MB the L3, 64 MB neither); ``scores_forward_share``: the forward's part
      (what checkpointing recomputes).
    The head dimension d scales the products only, so a model's eager step follows from both parts.
    """
    dt = DTYPES[dtype]
    size = torch.tensor([], dtype=dt).element_size()
    b, h, s, d = (2, 16, 2048, 128) if device == "cuda" else (1, 8, 256, 32)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, d, device=device, dtype=dt)

    def products() -> None:
        torch.matmul(torch.matmul(q, k.transpose(-1, -2)), v).backward(g)
        q.grad = k.grad = v.grad = None
    out: dict = {"bmm": 12.0 * b * h * s * s * d / timer(products, reps=5), "scores": {}}
    shares = []
    for b, h, s in ([(2, 16, 2048), (8, 16, 2048)] if device == "cuda" else [(1, 4, 256), (1, 4, 1024), (1, 16, 1024)]):
        x = torch.randn(b, h, s, s, device=device, dtype=dt, requires_grad=True)
        mask = torch.full((s, s), float("-inf"), device=device, dtype=dt).triu(1)
        gs = torch.randn(b, h, s, s, device=device, dtype=dt)

        def forward() -> torch.Tensor:  # as eager_attention_forward: scale, mask add, fp32 softmax, cast back
            return torch.softmax(x * 0.125 + mask, dim=-1, dtype=torch.float32).to(dt)

        def both() -> None:
            forward().backward(gs)
            x.grad = None
        t = timer(both, reps=3)
        nbytes = b * h * s * s * size
        # the page faults of its five new matrices (scale, mask add, softmax; two gradients) when they are
        # above glibc's mmap threshold: counted apart by the time model (memfit.estimate.faults)
        faults = first_touch * nbytes * 5 if nbytes >= GLIBC_MMAP_THRESHOLD_MAX else 0.0
        out["scores"][str(nbytes)] = max(t - faults, 0.5 * t) / (b * h * s * s)
        shares.append(min(1.0, timer(forward, reps=3) / t))
    out["scores_forward_share"] = sorted(shares)[len(shares) // 2]
    return out


def bandwidth_rate(device: str, timer: _Timer) -> float:
    n = (64 if device == "cuda" else 4) * (1 << 20)
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    c = torch.empty_like(a)

    def step() -> None:
        for _ in range(4):
            torch.add(a, b, out=c)
    return 4 * 3 * 4.0 * n / timer(step)


def first_touch_seconds_per_byte(timer: _Timer) -> float:
    """CPU: seconds per byte a fresh 64 MB tensor costs over writing one that exists — glibc serves it
    with mmap (above its 32 MiB threshold ceiling), the kernel maps and zeroes each page on first touch
    (memfit.estimate.faults)."""
    n = 16 << 20  # 64 MB of fp32
    kept = torch.empty(n)

    def fresh() -> None:
        torch.empty(n).fill_(1.0)
    t = timer.interleaved({"fresh": fresh, "kept": lambda: kept.fill_(1.0)}, rounds=5)
    return max(0.0, t["fresh"] - t["kept"]) / (4.0 * n)


def op_seconds(device: str, timer: _Timer) -> float:
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


def adamw_seconds(device: str, timer: _Timer) -> dict[str, float]:
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


def deepspeed_cpu_adam_seconds(timer: _Timer) -> Optional[float]:
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


def copy_rates(timer: _Timer) -> dict[str, float]:
    """Pinned host<->device copies (CUDA only), bytes/s each way."""
    n = 64 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    return {"h2d": n / timer(lambda: dev.copy_(host, non_blocking=True)),
            "d2h": n / timer(lambda: host.copy_(dev, non_blocking=True))}


def nf4_dequant_rate(device: str, timer: _Timer) -> Optional[float]:
    """bitsandbytes NF4 dequantisation, elements/s (None where bitsandbytes cannot run here)."""
    try:
        import bitsandbytes.functional as BF

        w = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
        q, state = BF.quantize_4bit(w, quant_type="nf4")
        return w.numel() / timer(lambda: BF.dequantize_4bit(q, state), reps=4)
    except Exception:  # no bitsandbytes, or no kernel for this device
        return None


def nf4_linear_call_seconds(device: str, timer: _Timer) -> Optional[float]:
    """bitsandbytes ``Linear4bit`` forward + input gradient at a width where the work is small, less the same
    dense frozen linear: the per-call cost of its Python, quant-state handling and dequantised copy (CPU here:
    ~0.5 ms, whatever the width up to 256). None where bitsandbytes cannot run here."""
    try:
        import bitsandbytes as bnb

        dt = torch.float32 if device == "cpu" else torch.bfloat16
        dense = torch.nn.Linear(256, 256, bias=False, device=device, dtype=dt).requires_grad_(False)
        lin = bnb.nn.Linear4bit(256, 256, bias=False, compute_dtype=dt, quant_type="nf4")
        lin.weight = bnb.nn.Params4bit(dense.weight.data.to("cpu", torch.float32).clone(), requires_grad=False,
                                       quant_type="nf4")
        lin = lin.to(device)
        x = torch.randn(64, 256, device=device, dtype=dt, requires_grad=True)
        g = torch.randn(64, 256, device=device, dtype=dt)

        def run(layer: torch.nn.Module) -> Callable[[], None]:
            def step() -> None:
                layer(x).backward(g)
                x.grad = None
            return step
        t = timer.interleaved({"nf4": run(lin), "dense": run(dense)}, rounds=7)
        return max(0.0, t["nf4"] - t["dense"])
    except Exception:  # no bitsandbytes, or no kernel for this device
        return None


def _collective_rank(rank: int, world: int, init: str, backend: str, conn) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    timer = _Timer(device)
    big = torch.ones((64 if device == "cuda" else 4) << 18, device=device)  # 1 MiB elements on CPU
    small = torch.ones(256, device=device)

    def reduce(t: torch.Tensor) -> Callable[[], None]:
        return lambda: dist.all_reduce(t)
    t_big, t_small = timer(reduce(big), reps=4), timer(reduce(small), reps=8)
    # FSDP2 and DeepSpeed's parameter gathers use the tensor forms of all-gather / reduce-scatter
    # (all_gather_single / reduce_scatter_single, all_gather_into_tensor): timed on their own
    gathered, full = torch.empty(world * big.numel(), device=device), torch.ones(world * big.numel(), device=device)
    small_out, small_in = torch.empty(world * small.numel(), device=device), torch.ones(world * small.numel(), device=device)
    shard, small_shard = torch.empty_like(big), torch.empty_like(small)
    ag = [timer(lambda: dist.all_gather_into_tensor(o, i), reps=4) for o, i in ((gathered, big), (small_out, small))]
    rs = [timer(lambda: dist.reduce_scatter_tensor(o, i), reps=4) for o, i in ((shard, full), (small_shard, small_in))]
    if rank == 0:
        wire = big.numel() * 4.0 * (world - 1) / world
        conn.send({"backend": backend, "bus_bytes_per_s": 2.0 * wire / max(t_big - t_small, 1e-9), "latency_s": t_small,
                   "all_gather": {"bus_bytes_per_s": world * wire / max(ag[0] - ag[1], 1e-9), "latency_s": ag[1]},
                   "reduce_scatter": {"bus_bytes_per_s": world * wire / max(rs[0] - rs[1], 1e-9), "latency_s": rs[1]}})
    dist.destroy_process_group()


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


def _cpu_part(cores: int, say: Callable[[str], None]) -> dict:
    out: dict = {"gemm": {}, "attention": {}, "bandwidth": {}, "optimizer": {}}
    touch = 0.0
    for t in sorted({1, cores}):
        torch.set_num_threads(t)
        timer = _Timer("cpu", one_thread=t == 1)
        key = str(t)
        say(f"GEMM, {t} thread(s)")
        out["gemm"][key] = gemm_rates("cpu", ["fp32", "bf16"] if t == 1 else ["fp32"], timer)
        if t == 1:
            out["bandwidth"]["first_touch_s_per_byte"] = touch = first_touch_seconds_per_byte(timer)
        say(f"attention eager/SDPA, {t} thread(s)")
        out["attention"][key] = attention_rates("cpu", ["fp32"], timer, touch)
        say(f"bandwidth and AdamW, {t} thread(s)")
        out["bandwidth"][key] = bandwidth_rate("cpu", timer)
        out["optimizer"][key] = adamw_seconds("cpu", timer)
        if t == 1:
            out["op_seconds"] = op_seconds("cpu", timer)
            say("dispatch of transformers' Llama layers and PEFT adapters")
            out["overheads"] = model_overheads("cpu", timer)
            say("NF4 dequantisation")
            out["dequant"] = {"nf4": nf4_dequant_rate("cpu", timer),
                              "nf4_call_s": nf4_linear_call_seconds("cpu", timer)}
            # the one-thread GEMMs and bandwidth again, some seconds later: a shared machine's speed drifts
            # between moments (±20-30 % here); the geometric mean of two passes halves what one moment weighs
            # (and the profile is the median of the last calibrations: memfit.spec.hwprofile.with_history)
            say("GEMM and bandwidth again, 1 thread")
            again = {"gemm": gemm_rates("cpu", ["fp32"], timer), "bandwidth": bandwidth_rate("cpu", timer)}
            for part in again:
                out[part][key] = _mean_rates(out[part][key], again[part])
    return out


def _mean_rates(a: Any, b: Any) -> Any:
    """The geometric mean of two measurements of the same table, leaf by leaf (a's entries that b lacks
    are kept; shapes and widths are equal in both)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _mean_rates(v, b[k]) if k in b else v for k, v in a.items()}
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0 and not isinstance(a, bool):
        return (a * b) ** 0.5
    return a


def _cuda_part(say: Callable[[str], None]) -> dict:
    timer = _Timer("cuda")
    say("GEMM on the GPU")
    gemm = {"device": gemm_rates("cuda", ["fp32", "bf16", "fp16"], timer)}
    say("attention eager/SDPA on the GPU")
    attention = {"device": attention_rates("cuda", ["bf16", "fp16", "fp32"], timer)}
    say("bandwidth, AdamW, copies, NF4 on the GPU")
    out = {"gemm": gemm, "attention": attention, "bandwidth": {"device": bandwidth_rate("cuda", timer)},
           "optimizer": {"device": adamw_seconds("cuda", timer)}, "op_seconds": op_seconds("cuda", timer),
           "copies": copy_rates(timer),
           "dequant": {"nf4": nf4_dequant_rate("cuda", timer), "nf4_call_s": nf4_linear_call_seconds("cuda", timer)},
           "overheads": model_overheads("cuda", timer)}
    torch.cuda.synchronize()
    return out


def calibrate_hardware(progress: Progress = None, world: Optional[int] = None) -> hwprofile.HardwareRates:
    """Run the micro-benchmarks of this machine; ``world``: processes for the collective (default: the
    GPU count where there are several, 2 on a CPU machine)."""
    from memfit.spec.hardware import local_fingerprint

    from memfit.train.quiet import quiet_libraries

    quiet_libraries()  # the import chatter of torchao / bitsandbytes / DeepSpeed: calibration runs silently
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    steps = 4 if cuda else 3 * len({1, cores}) + 4
    count = [0]

    def say(what: str) -> None:
        count[0] += 1
        if progress is not None:
            progress(f"[{min(count[0], steps)}/{steps}] {what} ({time.perf_counter() - t0:.0f} s)")
    threads = torch.get_num_threads()
    try:
        part = _cuda_part(say) if cuda else _cpu_part(cores, say)
        torch.set_num_threads(cores)
        cpu_timer = _Timer("cpu")
        say("CPU optimizers and collectives")
        optimizer = dict(part["optimizer"])
        optimizer["cpu_torch"] = adamw_seconds("cpu", cpu_timer)["per_param"] if cuda else \
            part["optimizer"][str(cores)]["per_param"]
        optimizer["cpu_deepspeed"] = deepspeed_cpu_adam_seconds(cpu_timer)
        n = world or (torch.cuda.device_count() if cuda else 2)
        backend = "nccl" if cuda else "gloo"
        collectives = {}
        if n > 1 and (not cuda or torch.cuda.device_count() >= n):
            rate = collective_rates(n, backend)
            if rate:
                collectives[str(n)] = rate
    finally:
        torch.set_num_threads(threads)
    return hwprofile.HardwareRates(
        device="cuda" if cuda else "cpu", measured_at=time.strftime("%Y-%m-%d"), cores=cores,
        gemm=part["gemm"], attention=part["attention"], bandwidth=part["bandwidth"],
        op_seconds=float(part["op_seconds"]), optimizer=optimizer, copies=part.get("copies", {}),
        collectives=collectives, dequant=part.get("dequant", {}), overheads=part.get("overheads", {}),
        fingerprint=local_fingerprint(),
        took_seconds=round(time.perf_counter() - t0, 2))


def ensure_hardware_profile(force: bool = False, progress: Progress = None) -> tuple[hwprofile.HardwareRates, bool]:
    """(rates, measured now): the cached profile of this machine, measured and saved when absent, ignored
    (corrupt / foreign) or ``force``; a new calibration joins the kept ones (the profile is their median)."""
    from memfit.spec.hardware import local_fingerprint

    fp = local_fingerprint()
    cached, _ = hwprofile.load_cached(fp)
    if cached is not None and not force:
        return cached, False
    rates = hwprofile.with_history(calibrate_hardware(progress), cached)  # median with the last calibrations
    hwprofile.save(rates)
    return rates, True


def model_overheads(device: str, timer: _Timer) -> dict[str, float]:
    """Dispatch cost of transformers' own Llama code, forward + backward, at widths where compute is nil:
    per decoder layer (from 2 vs 4 layers), the rest of the model (embedding, mask, norm, head, loss),
    per LoRA-adapted linear (PEFT) and eager attention's extra per layer."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    ids = torch.randint(0, 64, (1, 8), device=device)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def step_of(layers: int, lora: bool = False, attn: str = "sdpa", gc: bool = False) -> Callable[[], None]:
        cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                          vocab_size=64, num_hidden_layers=layers, max_position_embeddings=64,
                          attn_implementation=attn)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(device)
        if gc:  # as memfit's methods enable it (memfit.methods.base.GC_KWARGS: non-reentrant)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            model = get_peft_model(model, LoraConfig(r=2, target_modules=targets, lora_dropout=0.0))
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            for p in params:
                p.grad = None
        return step
    t = timer.interleaved({"two": step_of(2), "four": step_of(4), "lora": step_of(4, lora=True),
                           "eager": step_of(4, attn="eager"), "gc": step_of(4, gc=True)})
    two, four = t["two"], t["four"]
    layer = max(0.0, (four - two) / 2)
    return {"layer": layer, "model": max(0.0, two - 2 * layer),
            "adapter": max(0.0, (t["lora"] - four) / (4 * len(targets))),
            "eager_layer_extra": max(0.0, (t["eager"] - four) / 4),
            "gc_layer_extra": max(0.0, (t["gc"] - four) / 4)}
