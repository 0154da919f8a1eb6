"""The probe as a ``transformers.TrainerCallback``: what it measures is exactly memfit's training step.

Steps before ``warmup`` are excluded (the first step creates the optimizer state and warms caches). The
first measured step runs under the memory probe; the following ones are timed without it. With
``out_path`` set (``{rank}`` is replaced by the process rank), each rank writes its own JSON when
training ends; the runner merges them.

The same callback enforces an optional memory cap (``memory_limit_bytes``, compared with the process's
peak RSS after every micro-step) by raising :class:`MemoryLimitExceeded`, and can inject an
out-of-memory error at a given step (tests, fallback drills).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from transformers import TrainerCallback

from memfit.measure import probe as P


class MemoryLimitExceeded(RuntimeError):
    """The configured memory cap was crossed (treated like an out-of-memory error by --fallback)."""


def process_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _device_of(model: Any) -> str:
    try:
        return str(next(model.parameters()).device)
    except (StopIteration, AttributeError):
        return "cuda" if torch.cuda.is_available() else "cpu"


def write_json_atomic(obj: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh, indent=2)
    os.replace(tmp, path)
    return path


class ProbeCallback(TrainerCallback):
    def __init__(self, *, warmup: int = 1, steps: int = 3, out_path: Optional[str] = None,
                 logits_bytes: Optional[Callable[[int], bool]] = None, categories: bool = True,
                 memory_limit_bytes: Optional[int] = None, inject_oom_at: Optional[int] = None) -> None:
        self.warmup, self.steps = warmup, steps
        self.out_path = out_path
        self.logits_bytes = logits_bytes
        self.categories = categories
        self.memory_limit_bytes = memory_limit_bytes
        self.inject_oom_at = inject_oom_at
        self._probe: Optional[P.TensorMemoryProbe] = None
        self._model = self._optimizer = None
        self._t0 = 0.0
        self._times: list[float] = []
        self._cpu_times: list[float] = []  # process CPU seconds of the timed steps (all threads)
        self._c0 = 0.0
        self._profiled_time: Optional[float] = None
        self._probe_result: Optional[P.ProbeResult] = None
        self._rss_peak = 0
        self._context: Optional[int] = None
        self._done = False

    # --------------------------------------------------------------- helpers
    def _baseline(self) -> dict[str, list]:
        """What is live between steps, by component (for the raw-event figure and its breakdown)."""
        parts: dict[str, list] = {"parameters": [], "gradients": [], "optimizer_state": []}
        if self._model is not None:
            parts["parameters"] = [*self._model.parameters(), *self._model.buffers()]
            parts["gradients"] = [p.grad for p in self._model.parameters() if p.grad is not None]
        if self._optimizer is not None:
            opt = getattr(self._optimizer, "optimizer", self._optimizer)  # accelerate wrapper
            parts["optimizer_state"] = [v for state in getattr(opt, "state", {}).values()
                                        for v in state.values() if torch.is_tensor(v)]
        return parts

    def _measuring(self, step: int) -> bool:
        return self.warmup <= step < self.warmup + self.steps

    def _check_limit(self, state: Any) -> None:
        if self.memory_limit_bytes is not None:
            rss = P.peak_rss_bytes()
            if rss > self.memory_limit_bytes:
                raise MemoryLimitExceeded(
                    f"peak RSS {rss / 1e9:.3f} GB crossed the memory limit "
                    f"{self.memory_limit_bytes / 1e9:.3f} GB at step {state.global_step + 1}")

    # --------------------------------------------------------------- events
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self._model, self._optimizer = model, optimizer
        if torch.cuda.is_available() and model is not None and _device_of(model).startswith("cuda"):
            self._context = P.cuda_context_bytes(torch.device(_device_of(model)))

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self._model = model if model is not None else self._model
        self._optimizer = optimizer if optimizer is not None else self._optimizer
        step = state.global_step  # steps completed so far; this is step `step + 1`
        if self.inject_oom_at is not None and step + 1 == self.inject_oom_at:
            raise torch.OutOfMemoryError(f"injected out-of-memory at step {step + 1} (test drill)")
        if self._measuring(step):
            if step == self.warmup:
                P.reset_peak_rss()
                self._probe = P.TensorMemoryProbe(_device_of(self._model), categories=self.categories,
                                                  logits_bytes=self.logits_bytes,
                                                  baseline=self._baseline).start()
            self._t0 = time.perf_counter()
            self._c0 = time.process_time()

    def on_substep_end(self, args, state, control, **kw):
        self._check_limit(state)

    def on_step_end(self, args, state, control, **kw):
        step = state.global_step - 1  # the step that just finished (0-based)
        self._check_limit(state)
        if not self._measuring(step):
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._t0
        cpu_elapsed = time.process_time() - self._c0
        if self._probe is not None:
            self._probe_result = self._probe.stop()
            self._probe = None
            self._profiled_time = elapsed
            self._rss_peak = P.peak_rss_bytes()
        else:
            self._times.append(elapsed)
            self._cpu_times.append(cpu_elapsed)
            self._rss_peak = max(self._rss_peak, P.peak_rss_bytes())
        if step == self.warmup + self.steps - 1:
            self._done = True

    def on_train_end(self, args, state, control, **kw):
        if self.out_path and self._probe_result is not None:
            path = Path(self.out_path.replace("{rank}", str(process_rank())))
            write_json_atomic(self.result(), path)

    # --------------------------------------------------------------- result
    def result(self) -> dict[str, Any]:
        """This rank's figures (the ``measured`` object's per-rank entry)."""
        r = self._probe_result
        if r is None:
            raise RuntimeError(f"no measured step: the run needs at least {self.warmup + 1} steps "
                               f"(warm-up {self.warmup} + 1)")
        step_s = statistics.median(self._times) if self._times else self._profiled_time
        return {
            "rank": process_rank(),
            "device": r.device,
            "peak_allocated_bytes": r.peak_allocated_bytes,
            "peak_reserved_bytes": r.peak_reserved_bytes,
            "peak_rss_bytes": self._rss_peak or P.peak_rss_bytes(),
            "cuda_context_bytes": self._context,
            "components": r.components,
            "step_seconds": step_s,
            "step_seconds_profiled": self._profiled_time,
            "step_seconds_all": list(self._times),
            "step_cpu_seconds": statistics.median(self._cpu_times) if self._cpu_times else None,
            "timed_steps": len(self._times),
            "warmup_steps": self.warmup,
            "method": r.method,
            "raw_events_peak_bytes": r.raw_events_peak_bytes,
            "baseline_bytes": r.baseline_bytes,
        }
