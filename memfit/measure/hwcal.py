"""``memfit calibrate --hardware``: time what a training step spends its time on, once per machine.

Runs the micro-benchmarks (memfit.measure.kernels, memfit.measure.collective_bench) in one process — the
whole run ~20 s on a 2-core CPU — and keeps the result as a ``memfit.spec.hwprofile.HardwareRates``: a new
calibration joins the kept ones and the profile is their per-figure median (``hwprofile.with_history``).
On a CPU every figure is measured at one thread and at all cores, the one-thread GEMMs and bandwidth
twice; on CUDA at the device.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch

from memfit.measure.collective_bench import collective_rates
from memfit.measure.kernels import (Timer, adamw_seconds, attention_rates, bandwidth_rate, copy_rates,
                                    deepspeed_cpu_adam_seconds, dropout_seconds_per_value,
                                    first_touch_seconds_per_byte, gemm_rates, op_seconds)
from memfit.measure.overheads import model_overheads, nf4_dequant_rate, nf4_linear_call_seconds
from memfit.spec import hwprofile

Progress = Optional[Callable[[str], None]]


def _cpu_part(cores: int, say: Callable[[str], None]) -> dict:
    out: dict = {"gemm": {}, "attention": {}, "bandwidth": {}, "optimizer": {}}
    touch = 0.0
    for t in sorted({1, cores}):
        torch.set_num_threads(t)
        timer = Timer("cpu", one_thread=t == 1)
        key = str(t)
        say(f"GEMM, {t} thread(s)")
        out["gemm"][key] = gemm_rates("cpu", ["fp32", "bf16"] if t == 1 else ["fp32"], timer)
        if t == 1:
            out["bandwidth"]["first_touch_s_per_byte"] = touch = first_touch_seconds_per_byte(timer)
            out["bandwidth"]["dropout_s_per_value"] = dropout_seconds_per_value(timer)
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
    timer = Timer("cuda")
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
        cpu_timer = Timer("cpu")
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
        device="cuda" if cuda else "cpu", measured_at=time.strftime("%Y-%m-%d"), measured_unix=time.time(),
        cores=cores,
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
