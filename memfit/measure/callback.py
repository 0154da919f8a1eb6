"""The probe as a ``transformers.TrainerCallback``: what it measures is exactly memfit's training step.

Steps before ``warmup`` are excluded (the first step creates the optimizer state and warms caches). The
first measured step runs under the memory probe; the following ones are timed without it, each over the whole
loop iteration, ``on_step_begin`` to the next ``on_step_begin``: what a user's tokens/s meets, with the
Trainer's work outside the step proper (fetching and counting the next batch, logging, its gathers across
ranks). The last timed iteration therefore needs one more step after it (memfit.measure.worker runs it). With
``out_path`` set (``{rank}`` is replaced by the process rank), each rank writes its own JSON when
training ends; the runner merges them.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from transformers import TrainerCallback

from memfit.errors import MemfitError
from memfit.measure import probe as P
from memfit.measure.baton import timed_steps


def process_rank() -> int:
    from memfit.distributed.ranks import rank_info

    return rank_info()[0]


def _device_of(model: Any) -> str:
    try:
        return str(next(model.parameters()).device)
    except (StopIteration, AttributeError):
        return "cuda" if torch.cuda.is_available() else "cpu"


def write_json_atomic(obj: Any, path: Path) -> Path:
    from memfit.io import write_json

    return write_json(path, obj)


class ProbeCallback(TrainerCallback):
    def __init__(self, *, warmup: int = 1, steps: int = 3, out_path: Optional[str] = None,
                 logits_bytes: Optional[Callable[[int], bool]] = None, categories: bool = True,
                 expect_shape: Optional[tuple[int, int]] = None, gate: Any = None) -> None:
        self.warmup, self.steps = warmup, steps
        self.gate = gate  # memfit.measure.baton.Gate: step only while holding the baton (interleaved runs)
        self.turn = getattr(gate, "turn", 1) if gate is not None else 1  # steps per baton
        self._settle = P.settles_malloc()  # RSS under the harness's malloc, then time under a user's
        self._timed, self._total = timed_steps(warmup, steps, self.turn, self._settle)
        self.out_path = out_path
        self.logits_bytes = logits_bytes
        self.categories = categories
        self._probe: Optional[P.TensorMemoryProbe] = None
        self._model = self._optimizer = None
        self._t0 = self._c0 = 0.0
        self._times: list[float] = []
        self._windows: list[float] = []  # on_step_begin -> on_step_end of the timed steps
        self._cpu_times: list[float] = []  # process CPU time per timed step (all threads; steadier than wall)
        self._profiled_time: Optional[float] = None
        self._probe_result: Optional[P.ProbeResult] = None
        self._rss_peak = 0
        self._timing: Optional[int] = None  # the step whose iteration is being timed
        self._timed_threshold: Optional[int] = None  # glibc's mmap threshold set for the timed steps
        self._holding = False  # this process holds the baton (gate) now
        self._context: Optional[int] = None
        self.expect_shape = tuple(expect_shape) if expect_shape else None
        self._shapes: list[tuple[int, ...]] = []
        self._hook = None

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
        return step == self.warmup or step in self._timed

    def _record_shape(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_tensor(ids):
            self._shapes.append(tuple(ids.shape))

    def _check_shapes(self, step: int) -> None:
        """Every forward of the step had the planned (micro_batch, seq_len), or the figure is not of the
        planned run: fail loudly rather than report it."""
        if self.expect_shape is None:
            return
        shapes, self._shapes = self._shapes, []
        bad = [s for s in shapes if s != self.expect_shape]
        if bad or not shapes:
            got = bad[0] if bad else "no forward pass seen"
            raise MemfitError(f"step {step + 1} ran input_ids of shape {got}, not the planned "
                              f"(micro_batch, seq_len) = {self.expect_shape}; its memory would not be "
                              "of the planned run, so nothing is reported")

    # --------------------------------------------------------------- events
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self._model, self._optimizer = model, optimizer
        if self.expect_shape is not None and model is not None and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._record_shape, with_kwargs=True)
        if torch.cuda.is_available() and model is not None and _device_of(model).startswith("cuda"):
            self._context = P.cuda_context_bytes(torch.device(_device_of(model)))

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self._model = model if model is not None else self._model
        self._optimizer = optimizer if optimizer is not None else self._optimizer
        step = state.global_step  # steps completed so far; this is step `step + 1`
        if self._timing is not None:  # the previous timed iteration ends here
            self._record_iteration()
        if self._settle and step == self.warmup + 2:  # the probed step and the next one held the RSS peak
            self._rss_peak = max(self._rss_peak, P.peak_rss_bytes())
            self._timed_threshold = P.settle_malloc()
        if self.gate is not None and (not self._holding or step % self.turn == 0):
            if self._holding:  # the previous iteration (its logging, the next batch) ran under the baton too
                self.gate.after_step(last=False)
            self.gate.before_step()
            self._holding = True
        if self._measuring(step):
            if step == self.warmup:
                P.reset_peak_rss()
                self._probe = P.TensorMemoryProbe(_device_of(self._model), categories=self.categories,
                                                  logits_bytes=self.logits_bytes,
                                                  baseline=self._baseline).start()
            self._t0 = time.perf_counter()
            self._c0 = time.process_time()
            self._timing = None if step == self.warmup else step

    def on_step_end(self, args, state, control, **kw):
        step = state.global_step - 1  # the step that just finished (0-based)
        if self._probe is not None:
            self._record_probed()
        elif self._timing == step:  # the step proper, without what the loop runs around it
            self._windows.append(time.perf_counter() - self._t0)
        if self.gate is not None and step + 1 >= min(state.max_steps, self._total):
            self.gate.after_step(last=True)  # after the timing and the probe's own work
            self._holding = False
        self._check_shapes(step)

    def _record_probed(self) -> None:
        """The probed step: its memory, and its time from on_step_begin to on_step_end (probe included)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._profiled_time = time.perf_counter() - self._t0
        self._probe_result = self._probe.stop()
        self._probe = None
        self._rss_peak = P.peak_rss_bytes()

    def _record_iteration(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._times.append(time.perf_counter() - self._t0)
        self._cpu_times.append(time.process_time() - self._c0)
        if not self._settle:  # the same malloc settings as the probed step: its RSS counts
            self._rss_peak = max(self._rss_peak, P.peak_rss_bytes())
        self._timing = None

    def on_train_end(self, args, state, control, **kw):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
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
            # the step proper (on_step_begin -> on_step_end); the rest of the iteration is the Trainer's
            # logging, its gathers and the next batch's fetch
            "step_window_seconds": statistics.median(self._windows) if self._windows else None,
            "step_cpu_seconds": statistics.median(self._cpu_times) if self._cpu_times else None,
            "timed_steps": len(self._times),
            "timed_window": "loop iteration (on_step_begin to the next on_step_begin)",
            "warmup_steps": self.warmup,
            "method": r.method,
            "raw_events_peak_bytes": r.raw_events_peak_bytes,
            "baseline_bytes": r.baseline_bytes,
            # glibc's mmap threshold this process ran with (None: its defaults): whether the heap kept the
            # holes of freed tensors in the RSS (memfit.measure.compare.heap_holes_resident)
            "malloc_mmap_threshold": _mmap_threshold(),
            # the timed steps' (memfit.measure.probe.settle_malloc), where it differs from the probed step's
            "timed_malloc_mmap_threshold": self._timed_threshold or _mmap_threshold(),
        }


def _mmap_threshold() -> Optional[int]:
    value = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    try:
        return int(value) if value is not None else None
    except ValueError:  # glibc ignores a value it cannot parse
        return None
