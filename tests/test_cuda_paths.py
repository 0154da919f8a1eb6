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

import contextlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

# imported before any fake is installed: libraries probe torch.cuda as they import
from memfit.measure import hwcal, probe
from memfit.measure.kernels import Timer, copy_rates
from memfit.meft import MeftConfig, add_meft, adapters
from memfit.meft.transfer import Traffic, Transfer
from memfit.spec import hwprofile
from memfit.train.callbacks import peak_memory_bytes

GB = 10**9


class FakeEvent:
    def __init__(self, cuda: "FakeCuda", enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.cuda, self.enable_timing = cuda, enable_timing
        self.recorded_on: Any = None
        self.synchronized = 0
        cuda.events.append(self)

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream if stream is not None else self.cuda.current
        self.cuda.log("event.record", self.recorded_on.name)

    def synchronize(self) -> None:
        assert self.recorded_on is not None, "synchronize on an event never recorded"
        self.synchronized += 1
        self.cuda.log("event.synchronize")

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.enable_timing and end.enable_timing, "elapsed_time needs enable_timing=True events"
        assert end.synchronized, "elapsed_time before the end event was synchronized"
        return self.cuda.elapsed_ms


class FakeStream:
    def __init__(self, cuda: "FakeCuda", device: Any = None, priority: int = 0, name: str = "side") -> None:
        self.cuda, self.device, self.name = cuda, device, name
        self.waited: list = []
        cuda.streams.append(self)

    def wait_event(self, event: FakeEvent) -> None:
        assert event.recorded_on is not None
        self.waited.append(("event", event))
        self.cuda.log(f"{self.name}.wait_event", event.recorded_on.name)

    def wait_stream(self, stream: "FakeStream") -> None:
        self.waited.append(("stream", stream))
        self.cuda.log(f"{self.name}.wait_stream", stream.name)

    def synchronize(self) -> None:
        self.cuda.log(f"{self.name}.synchronize")


@dataclass
class FakeCuda:
    """Known numbers for the counters, and every call in order as (name, detail)."""

    allocated: int = 3 * GB  # memory_allocated: what is live at the window's start
    peak_allocated: int = 41 * GB  # max_memory_allocated
    peak_reserved: int = 47 * GB  # max_memory_reserved
    reserved: int = 45 * GB  # memory_reserved
    free_total: tuple = (30 * GB, 80 * GB)  # mem_get_info
    devices: int = 1
    elapsed_ms: float = 2.5
    calls: list = field(default_factory=list)
    events: list = field(default_factory=list)
    streams: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.default = FakeStream(self, name="default")
        self.current = self.default

    def log(self, name: str, detail: Any = None) -> None:
        self.calls.append((name, detail))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def install(self, monkeypatch: pytest.MonkeyPatch, available: bool = True) -> "FakeCuda":
        def counter(name: str, value: Any):
            def fn(device: Any = None) -> Any:
                self.log(name, None if device is None else str(device))
                return value
            return fn

        def synchronize(device: Any = None) -> None:
            self.log("synchronize", None if device is None else str(device))

        def reset_peak_memory_stats(device: Any = None) -> None:
            self.log("reset_peak_memory_stats", None if device is None else str(device))

        def current_stream(device: Any = None) -> FakeStream:
            self.log("current_stream", None if device is None else str(device))
            return self.current

        @contextlib.contextmanager
        def stream(s: FakeStream):
            self.log("stream.enter", s.name)
            before, self.current = self.current, s
            try:
                yield
            finally:
                self.current = before
                self.log("stream.exit", s.name)

        fakes = {
            "is_available": lambda: available, "is_initialized": lambda: available,
            "device_count": lambda: self.devices, "synchronize": synchronize,
            "reset_peak_memory_stats": reset_peak_memory_stats,
            "memory_allocated": counter("memory_allocated", self.allocated),
            "max_memory_allocated": counter("max_memory_allocated", self.peak_allocated),
            "max_memory_reserved": counter("max_memory_reserved", self.peak_reserved),
            "memory_reserved": counter("memory_reserved", self.reserved),
            "mem_get_info": counter("mem_get_info", self.free_total),
            "current_stream": current_stream, "stream": stream,
            "Event": lambda **kw: FakeEvent(self, **kw),
            "Stream": lambda device=None, priority=0: FakeStream(self, device, priority),
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(torch.cuda, name, fake)  # raises where torch.cuda has no such name

        def record_stream(tensor: torch.Tensor, s: FakeStream) -> None:
            assert isinstance(s, FakeStream), f"record_stream with {s!r}"
            self.log("record_stream", s.name)
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
        return self


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type == "cuda"
        except RuntimeError:
            return False
    return False


@pytest.fixture
def cuda_tensors_on_cpu(monkeypatch, fake_cuda) -> FakeCuda:
    """Tensors asked for on "cuda" (torch.zeros / torch.empty / Tensor.to) are made on the CPU; pinning is
    recorded (``pin_memory`` in the calls) and not done (a CPU-only torch cannot pin)."""
    zeros, empty, to = torch.zeros, torch.empty, torch.Tensor.to

    def factory(name: str, make):
        def fn(*args: Any, device: Any = None, pin_memory: bool = False, **kw: Any) -> torch.Tensor:
            if pin_memory:
                fake_cuda.log("pin_memory", name)
            if _is_cuda(device):
                fake_cuda.log(f"{name} on cuda")
                device = "cpu"
            return make(*args, device=device, **kw)
        return fn

    def to_cpu(self: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        if any(_is_cuda(a) for a in args) or _is_cuda(kw.get("device")):
            fake_cuda.log("to cuda", kw.get("non_blocking", False))
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
            if "device" in kw:
                kw["device"] = "cpu"
        return to(self, *args, **kw)

    def pin(self: torch.Tensor, *args: Any) -> torch.Tensor:
        fake_cuda.log("pin_memory", "tensor")
        return self
    monkeypatch.setattr(torch, "zeros", factory("zeros", zeros))
    monkeypatch.setattr(torch, "empty", factory("empty", empty))
    monkeypatch.setattr(torch.Tensor, "to", to_cpu)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    return fake_cuda


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


# --------------------------------------------------------------------------- MEFT's copy stream
class _Store:
    def __init__(self) -> None:
        self.got: list = []

    def accumulate(self, rows, gkeys, gvalues) -> None:
        self.got.append((rows.clone(), gkeys.clone(), gvalues.clone()))


def test_meft_transfer_on_cuda_copies_on_its_stream(cuda_tensors_on_cpu):
    cuda, traffic = cuda_tensors_on_cpu, Traffic()
    tr = Transfer(8, 4, torch.device("cuda"), torch.float32, traffic, pin=True)
    assert tr.cuda and tr.pin and isinstance(tr.stream, FakeStream) and str(tr.stream.device) == "cuda"
    assert cuda.calls.count(("zeros on cuda", None)) == 2  # the fixed device buffers
    assert cuda.calls.count(("pin_memory", "zeros")) == 4  # the four staging buffers, pinned
    stream = tr.stream

    # rows of the CPU tables into the device buffers, on the copy stream, the compute stream told to wait
    keys, values = torch.arange(40.0).reshape(10, 4), -torch.arange(40.0).reshape(10, 4)
    rows = torch.tensor([7, 2, 5])
    cuda.calls.clear()
    assert tr.load_rows(keys, values, rows) == 1
    assert torch.equal(tr.buf_keys[:3], keys[rows]) and torch.equal(tr.buf_values[:3], values[rows])
    assert traffic.current["h2d"] == 2 * 3 * 4 * 4
    done = tr._h2d_done
    assert done.recorded_on is stream
    assert ("event", done) in cuda.default.waited  # compute waits for the copy
    assert stream.waited and stream.waited[0][1].recorded_on is cuda.default  # the copy waits for compute
    assert cuda.names()[:3] == ["current_stream", "event.record", "stream.enter"]
    tr.load_rows(keys, values, torch.tensor([1]))
    assert done.synchronized == 1  # the staging is rewritten only after the last copy out of it finished

    # device -> host: a pinned host tensor and an event to wait on
    x = torch.randn(3, 4)
    cuda.calls.clear()
    host, event = tr.to_host(x)
    assert torch.equal(host, x) and event.recorded_on is stream
    assert ("record_stream", "side") in cuda.calls and ("pin_memory", "empty") in cuda.calls
    Transfer.wait_host(event)
    assert event.synchronized == 1
    assert traffic.current["d2h"] == x.numel() * 4

    # host -> device (indices): pinned, copied on the stream, handed to the compute stream
    idx = torch.tensor([0, 2, 1])
    cuda.calls.clear()
    out = tr.to_device(idx)
    assert torch.equal(out, idx)
    assert ("pin_memory", "tensor") in cuda.calls and ("to cuda", True) in cuda.calls
    assert ("stream", stream) in cuda.default.waited and ("record_stream", "default") in cuda.calls

    # gradients: copied on the stream now, scattered into the store only at the next flush
    store, gk, gv = _Store(), torch.randn(2, 4), torch.randn(2, 4)
    tr.push_grads(store, torch.tensor([3, 1]), gk, gv)
    assert store.got == []
    pending = tr._pending[0]
    assert pending.recorded_on is stream and pending.synchronized == 0
    tr.flush()
    assert pending.synchronized == 1 and len(store.got) == 1
    r, k, v = store.got[0]
    assert torch.equal(r, torch.tensor([3, 1])) and torch.equal(k, gk) and torch.equal(v, gv)
    tr.flush()
    assert len(store.got) == 1  # nothing left in flight


def test_meft_layer_gradients_through_the_cuda_copy_path_equal_the_cpu_path(cuda_tensors_on_cpu):
    """A MEFT layer's forward and backward with its Transfer on the CUDA branch (the copy stream, events,
    deferred gradient scatter) give the CPU branch's output and gradients."""
    def run(cuda_branch: bool):
        torch.manual_seed(0)
        model = add_meft(nn.Sequential(nn.Linear(16, 16)), MeftConfig(target=r"^0$", neurons=32, top_k=8,
                                                                      init_keys_from_ffn=False))
        a = adapters(model)["0"]
        a.store.values.normal_(0.0, 0.5)
        x = torch.randn(2, 5, 16)
        model(x)  # makes the Transfer
        if cuda_branch:
            a.transfer.cuda = True
            a.transfer.stream = torch.cuda.Stream(device=a.transfer.device)
        out = model(x)
        out.square().sum().backward()
        a.transfer.flush()
        return out.detach(), a.store.grad_keys.clone(), a.store.grad_values.clone()
    fake_cuda = cuda_tensors_on_cpu
    ref = run(False)
    assert ("pin_memory", "zeros") in fake_cuda.calls  # with CUDA, MEFT pins its CPU store by default
    calls_before = len(fake_cuda.calls)
    got = run(True)
    assert len(fake_cuda.calls) > calls_before and "record_stream" in fake_cuda.names()
    for r, g in zip(ref, got):
        assert torch.allclose(r, g)
    assert ref[1].abs().sum() > 0 and ref[2].abs().sum() > 0  # the gradients did flow
