"""A stand-in for the few ``torch.cuda`` calls memfit makes (counters, events, streams), for running its CUDA
code paths on a CPU: tests/estimate/test_cuda_paths.py and tests/meft/test_cuda_meft.py.
``monkeypatch.setattr`` refuses a
name torch.cuda does not have, and the fakes' methods are checked against torch's own classes."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

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
