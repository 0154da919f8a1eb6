"""The CPU threads each process of a run uses: one decision, read by the prediction and by the runs.

:func:`run_threads` is the only rule. The time model reads it (memfit.steptime.speeds.threads_per_process)
and whatever starts training processes passes the same number on to them as ``OMP_NUM_THREADS`` (memfit's
launcher, ``memfit measure``'s runner), so a predicted step and the step that runs use the same threads
by construction. The one exception is an in-process ``memfit train`` without ``OMP_NUM_THREADS``: it may
take fewer threads on a busy machine (:func:`idle_cores`, memfit.train.api.cpu_threads), and its
prediction, made in that same process, reads torch's thread count after that choice.

Plain Python: torch is never imported here (only read from ``sys.modules`` where a caller imported it).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

ENV = "OMP_NUM_THREADS"
_PINNED: Optional[int] = None  # set by pinned(): the count a caller is about to give the processes


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def env_threads(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """``OMP_NUM_THREADS`` when it is a positive integer, else None."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def run_threads(processes: int = 1, environ: Optional[Mapping[str, str]] = None) -> int:
    """Threads each of ``processes`` CPU processes on this node runs: ``OMP_NUM_THREADS`` when set; else, for
    one process in a process that imported torch, torch's thread count (a training process: what it really
    runs); else the cores // processes (what memfit's launcher and ``memfit measure`` give their processes).
    Deterministic: it never reads the load average. ``environ``: the environment the processes will get
    (default this process's). Inside :func:`pinned`, the pinned count."""
    if _PINNED is not None and environ is None:
        return _PINNED
    n = env_threads(environ)
    if n is not None:
        return n
    torch = sys.modules.get("torch")
    if torch is not None and processes <= 1 and environ is None:
        try:
            return max(1, int(torch.get_num_threads()))
        except Exception:  # a partly imported torch: the cores rule
            pass
    return max(1, cores() // max(1, processes))


@contextmanager
def pinned(threads: int) -> Iterator[int]:
    """Within the block :func:`run_threads` answers ``threads``: a prediction made here is at the count the
    caller passes to the processes it starts (``memfit measure`` with an explicit thread count)."""
    global _PINNED
    before, _PINNED = _PINNED, max(1, int(threads))
    try:
        yield _PINNED
    finally:
        _PINNED = before


def idle_cores(limit: Optional[int] = None) -> int:
    """Cores other processes leave idle by the 1-minute load average (at least 1, at most ``limit``); all the
    cores where there is no load average."""
    n = cores()
    if hasattr(os, "getloadavg"):
        try:
            n = int(n - os.getloadavg()[0] + 0.5)
        except OSError:
            pass
    return max(1, min(n, limit) if limit is not None else n)
