"""memfit's CUDA code paths, run on a CPU through a stand-in for the few ``torch.cuda`` calls they make.

The paths: the memory probe's allocator counters (memfit.measure.probe), the training summary's peak
(memfit.train.callbacks), the CUDA hardware calibration (memfit.measure.hwcal, memfit.measure.kernels' event
timer and pinned copies) and MEFT's copy stream (memfit.meft.transfer). The stand-in (:class:`FakeCuda`)
replaces ``torch.cuda`` functions, ``Event`` and ``Stream`` with fakes that record each call and return known
numbers; ``monkeypatch.setattr`` refuses a name torch.cuda does not have, and the fakes' methods are checked
against torch's own classes, so a misspelt or wrong counter in memfit fails here. Where a path makes tensors
"on the GPU", :func:`cuda_tensors_on_cpu` makes them on the CPU (and records pinning instead of pinning).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

# imported before any fake is installed: libraries probe torch.cuda as they import
from memfit.measure import hwcal, probe
from memfit.measure.kernels import Timer, copy_rates
from memfit.spec import hwprofile
from memfit.train.callbacks import peak_memory_bytes
from cuda_fakes import GB, FakeCuda, FakeEvent, FakeStream, cuda_tensors_on_cpu, fake_cuda  # noqa: F401

def test_the_fakes_only_have_methods_torch_has():
    """A fake method torch lacks would let a misspelt call in memfit pass here."""
    for fake, real in ((FakeEvent, torch.cuda.Event), (FakeStream, torch.cuda.Stream)):
        methods = [n for n, v in vars(fake).items() if callable(v) and not n.startswith("_")]
        assert methods and all(hasattr(real, n) for n in methods), (fake, methods)
    assert hasattr(torch.Tensor, "record_stream") and hasattr(torch.Tensor, "pin_memory")


# --------------------------------------------------------------------------- the memory probe
@pytest.mark.parametrize("categories", [True, False])
def test_probe_reports_the_cuda_allocator_counters(monkeypatch, categories):
    # is_available stays False: the real profiler then drops its CUDA activity (with is_available True it
    # would start CUDA tracing on a CPU-only torch); the probe itself never asks
    fake_cuda = FakeCuda().install(monkeypatch, available=False)

    window = probe.TensorMemoryProbe("cuda", categories=categories)
    with window:
        x = torch.randn(256, 256, requires_grad=True)  # CPU work inside the window: not the GPU's figure
        (x @ x).sum().backward()
    res = window.result()
    assert res.device == "cuda"
    assert res.peak_allocated_bytes == fake_cuda.peak_allocated  # the counter, not the CPU events
    assert res.peak_reserved_bytes == fake_cuda.peak_reserved
    assert res.baseline_bytes == fake_cuda.allocated  # memory_allocated at the window's start
    assert res.raw_events_peak_bytes == fake_cuda.allocated  # no CUDA allocation events: the baseline alone
    assert sum(res.components.values()) == fake_cuda.peak_allocated  # the breakdown rescaled to the counter
    assert res.components["unattributed"] == fake_cuda.peak_allocated
    assert res.method == "torch.cuda.max_memory_allocated (+profiler categories)"
    names = fake_cuda.names()
    # the window opens on a synchronised device with its peak reset, then reads the counters at its close
    assert names.index("synchronize") < names.index("reset_peak_memory_stats") < names.index("memory_allocated")
    assert names.count("synchronize") == 2 and names.count("reset_peak_memory_stats") == 1
    assert names[-2:] == ["max_memory_allocated", "max_memory_reserved"]
    assert all(detail == "cuda" for name, detail in fake_cuda.calls)  # the probe's device, every call


def test_cuda_context_bytes_is_what_the_driver_holds_beyond_the_allocator(fake_cuda, monkeypatch):
    free, total = fake_cuda.free_total
    assert probe.cuda_context_bytes("cuda:0") == total - free - fake_cuda.reserved  # 80 - 30 - 45 = 5 GB
    assert fake_cuda.calls == [("mem_get_info", "cuda:0"), ("memory_reserved", "cuda:0")]
    FakeCuda(free_total=(70 * GB, 80 * GB)).install(monkeypatch)
    assert probe.cuda_context_bytes() == 0  # never negative
    FakeCuda().install(monkeypatch, available=False)
    assert probe.cuda_context_bytes() is None


def test_training_summary_peak_is_the_cuda_allocator_peak(fake_cuda, monkeypatch):
    assert peak_memory_bytes() == (fake_cuda.peak_allocated, "cuda_max_allocated")
    FakeCuda().install(monkeypatch, available=False)
    assert peak_memory_bytes()[1] == "peak_rss"


# --------------------------------------------------------------------------- the CUDA calibration
def test_kernel_timer_on_cuda_times_with_events(fake_cuda):
    ran = []
    t = Timer("cuda")(lambda: ran.append(1), reps=5, cap=10.0)
    assert t == pytest.approx(fake_cuda.elapsed_ms / 1e3)  # elapsed_time is in milliseconds
    assert len(ran) == 6  # a warm-up, then the repetitions
    assert len(fake_cuda.events) == 10 and all(e.enable_timing for e in fake_cuda.events)
    ends = fake_cuda.events[1::2]
    assert all(e.synchronized == 1 for e in ends)  # each end event waited on before reading the time
    got = Timer("cuda").interleaved({"a": lambda: None, "b": lambda: None}, rounds=3)
    assert got == {"a": pytest.approx(0.0025), "b": pytest.approx(0.0025)}


def test_pinned_copy_rates(cuda_tensors_on_cpu):
    cuda = cuda_tensors_on_cpu
    seen = []

    def timer(fn, **kw):
        fn()
        seen.append(fn)
        return 0.016
    n = 64 << 20
    assert copy_rates(timer) == {"h2d": pytest.approx(n / 0.016), "d2h": pytest.approx(n / 0.016)}
    assert len(seen) == 2
    assert ("pin_memory", "tensor") in cuda.calls and ("empty on cuda", None) in cuda.calls


def _fake_kernels(monkeypatch, calls: list) -> None:
    """hwcal's micro-benchmarks replaced by fakes that record how they were asked and return known rates."""
    def fake(name: str, value: Any):
        def fn(*args: Any, **kw: Any) -> Any:
            timer = next((a for a in args if hasattr(a, "one_thread")), None)
            device = next((a for a in args if isinstance(a, str)), None)
            calls.append((name, device, getattr(timer, "device", None), args))
            return value(*args) if callable(value) else value
        return fn
    rates = {
        "gemm_rates": lambda device, dtypes, timer: {d: {"large": 5e14, "small": 1e14, "skinny": 2e13,
                                                          "widths": {"small": 512.0, "large": 4096.0}}
                                                      for d in dtypes},
        "attention_rates": lambda device, dtypes, timer, *a: {"sdpa": {d: {"1024": 3e14} for d in dtypes},
                                                              "forward_share": {"sdpa": 0.25}},
        "bandwidth_rate": 4.2e12,
        "adamw_seconds": {"per_param": 3.3e-11, "per_tensor": 1e-5},
        "op_seconds": 3e-5,
        "copy_rates": {"h2d": 5.5e10, "d2h": 5.1e10},
        "nf4_dequant_rate": 9e11, "nf4_linear_call_seconds": 4.5e-4,
        "model_overheads": {"layer": 2e-3, "model": 4e-3, "adapter": 1e-4},
        "deepspeed_cpu_adam_seconds": None,
        "collective_rates": {"all_reduce": {"1048576": 1e11}},
    }
    for name, value in rates.items():
        monkeypatch.setattr(hwcal, name, fake(name, value))


def test_hardware_calibration_on_cuda(fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    fake_cuda.devices = 2
    calls: list = []
    _fake_kernels(monkeypatch, calls)
    lines: list = []
    threads = torch.get_num_threads()
    rates = hwcal.calibrate_hardware(progress=lines.append)
    assert torch.get_num_threads() == threads  # put back

    assert rates.device == "cuda" and rates.threads_key(8) == "device"
    assert rates.gemm == {"device": {d: {"large": 5e14, "small": 1e14, "skinny": 2e13,
                                         "widths": {"small": 512.0, "large": 4096.0}}
                                     for d in ("fp32", "bf16", "fp16")}}
    assert rates.attention["device"]["sdpa"]["bf16"] == {"1024": 3e14}
    assert rates.bandwidth == {"device": 4.2e12}
    assert rates.op_seconds == 3e-5 and rates.copies == {"h2d": 5.5e10, "d2h": 5.1e10}
    assert rates.dequant == {"nf4": 9e11, "nf4_call_s": 4.5e-4}
    assert rates.overheads == {"layer": 2e-3, "model": 4e-3, "adapter": 1e-4}
    # the GPU's AdamW, and torch's AdamW on the host's CPU (what offloaded optimizers run)
    assert rates.optimizer == {"device": {"per_param": 3.3e-11, "per_tensor": 1e-5}, "cpu_torch": 3.3e-11,
                               "cpu_deepspeed": None}
    assert rates.collectives == {"2": {"all_reduce": {"1048576": 1e11}}}  # NCCL over both devices
    by_name = {}
    for name, device, timer_device, args in calls:
        by_name.setdefault(name, []).append((device, timer_device, args))
    assert [a for _, _, a in by_name["collective_rates"]] == [(2, "nccl")]
    # every GPU micro-benchmark asked for the GPU and timed with the GPU's events
    for name in ("gemm_rates", "attention_rates", "bandwidth_rate", "op_seconds", "nf4_dequant_rate",
                 "nf4_linear_call_seconds", "model_overheads"):
        assert [(d, t) for d, t, _ in by_name[name]] == [("cuda", "cuda")], name
    assert [(d, t) for d, t, _ in by_name["adamw_seconds"]] == [("cuda", "cuda"), ("cpu", "cpu")]
    assert by_name["copy_rates"][0][1] == "cuda"
    assert [a[1] for _, _, a in by_name["gemm_rates"]] == [["fp32", "bf16", "fp16"]]
    assert "synchronize" in fake_cuda.names()
    assert [line.split(" (")[0] for line in lines] == ["[1/4] GEMM on the GPU", "[2/4] attention eager/SDPA on the GPU",
                                                      "[3/4] bandwidth, AdamW, copies, NF4 on the GPU",
                                                      "[4/4] CPU optimizers and collectives"]
    # the profile is saved and read back as the same figures
    again = hwprofile.HardwareRates.from_dict(rates.to_dict())
    assert again == rates


def test_hardware_calibration_on_one_gpu_skips_collectives(fake_cuda, monkeypatch):
    calls: list = []
    _fake_kernels(monkeypatch, calls)
    assert hwcal.calibrate_hardware().collectives == {}
    assert not [c for c in calls if c[0] == "collective_rates"]
