"""Trainer callbacks: step timing, metrics.jsonl, a rich progress bar; peak memory."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any, Optional

from transformers import TrainerCallback


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux VmHWM, which ``clear_refs`` can reset; else rusage)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_memory_bytes() -> tuple[int, str]:
    """(peak bytes, what it is): CUDA allocator peak on a GPU, else this process's peak RSS."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    return peak_rss_bytes(), "peak_rss"


class StepStats(TrainerCallback):
    """Wall time per optimizer step, tokens/s and the padded shape of what each step trained, kept for the
    summary and attached to each log line. The shapes come from :meth:`record_batch`, which the trainer
    calls with each micro-batch's tensor shape (no device sync)."""

    def __init__(self) -> None:
        self.batches: list[tuple[tuple[int, int], ...]] = []  # per step: (rows, padded length) per micro-batch
        self._micro: list[tuple[int, int]] = []
        self.step_times: list[float] = []
        self.cpu_times: list[float] = []  # process CPU seconds per step (all threads)
        self.losses: list[tuple[int, float]] = []
        self._t0: Optional[float] = None
        self._tokens0 = 0
        self._last_tps: Optional[float] = None
        self._window = [0.0, 0]  # seconds, tokens since last log

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()
        self._c0 = time.process_time()
        self._tokens0 = state.num_input_tokens_seen
        self._micro = []

    def record_batch(self, rows: int, length: int) -> None:
        self._micro.append((rows, length))

    def on_step_end(self, args, state, control, **kw):
        if self._t0 is None:
            return
        dt = time.perf_counter() - self._t0
        self.step_times.append(dt)
        self.cpu_times.append(time.process_time() - self._c0)
        self.batches.append(tuple(self._micro))
        self._window[0] += dt
        self._window[1] += state.num_input_tokens_seen - self._tokens0

    def on_log(self, args, state, control, logs=None, **kw):
        if logs is None:
            return
        secs, toks = self._window
        if secs > 0:
            self._last_tps = toks / secs
            logs["tokens_per_s"] = round(self._last_tps, 1)
            self._window = [0.0, 0]
        if self.step_times:
            logs["step_time_s"] = round(self.step_times[-1], 4)
            logs["step_cpu_s"] = round(self.cpu_times[-1], 4)
        if self.batches and self.batches[-1]:
            logs["padded_tokens"] = sum(r * w for r, w in self.batches[-1])  # rows × padded length, summed
            logs["padded_len"] = max(w for _, w in self.batches[-1])
        peak, kind = peak_memory_bytes()
        logs["peak_mem_bytes"] = peak
        logs["peak_mem_kind"] = kind
        if "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"])))

    def median_step_time(self) -> Optional[float]:
        """Median over steps, leaving out the first (warm-up) when there are enough."""
        times = self.step_times[1:] if len(self.step_times) > 2 else self.step_times
        return median(times) if times else None

    def tokens_per_s(self, total_tokens: int) -> Optional[float]:
        total = sum(self.step_times)
        return total_tokens / total if total > 0 else None


class MetricsWriter(TrainerCallback):
    """Append every log (train and eval) as one JSON line to ``metrics.jsonl``, flushed each time."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_log(self, args, state, control, logs=None, **kw):
        if not logs or not state.is_world_process_zero:
            return
        row: dict[str, Any] = {"step": state.global_step, "time": round(time.time(), 3)}
        row.update({k: (float(v) if hasattr(v, "item") else v) for k, v in logs.items()})
        try:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
                fh.flush()
        except OSError as err:  # e.g. a full disk: one line, not a traceback
            from memfit.io import write_error

            raise write_error(err, self.path, "metrics") from None


class RichProgress(TrainerCallback):
    """A progress bar with loss, tokens/s and peak memory (rank 0 only)."""

    def __init__(self, console=None) -> None:
        self.console = console
        self.progress = None
        self.task = None

    def on_train_begin(self, args, state, control, **kw):
        if not state.is_world_process_zero:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"), console=self.console, transient=False,
            auto_refresh=False,  # redrawn once per step: no render thread competing with the step
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=state.max_steps, completed=state.global_step,
                                           status="")

    def on_step_end(self, args, state, control, **kw):
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step, refresh=True)

    def on_log(self, args, state, control, logs=None, **kw):
        if self.progress is None or not logs:
            return
        parts = []
        if "loss" in logs:
            parts.append(f"loss {logs['loss']:.4f}")
        if "eval_loss" in logs:
            parts.append(f"eval {logs['eval_loss']:.4f}")
        if "tokens_per_s" in logs:
            parts.append(f"{logs['tokens_per_s']:.0f} tok/s")
        if "peak_mem_bytes" in logs:
            parts.append(f"peak {logs['peak_mem_bytes'] / 1e6:.0f} MB")
        if parts:
            self.progress.update(self.task, status="  ".join(parts), refresh=True)

    def on_train_end(self, args, state, control, **kw):
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)
        self.close()

    def close(self) -> None:
        """Stop the bar (and show the terminal's cursor again); also after an error or Ctrl-C."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
