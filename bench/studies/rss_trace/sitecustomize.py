"""RSS tracer for bench/studies/rss_breakdown.py: loaded by Python at start-up when this folder is on PYTHONPATH and
MEMFIT_RSS_TRACE names an output file; inert otherwise.

A daemon thread reads /proc/self/statm every 2 ms; at every new high of the resident size it records the
resident, file-backed and anonymous bytes and glibc's mallinfo2 (heap in use / free, mmapped). Once
transformers' Trainer exists it attaches a callback that marks train begin and each step's begin/end with
the same figures. At exit the JSON goes to $MEMFIT_RSS_TRACE.
"""

import atexit
import ctypes
import json
import os
import threading
import time

_OUT = os.environ.get("MEMFIT_RSS_TRACE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]


def _start() -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    t0 = time.perf_counter()
    trace = {"marks": [], "peak": None, "series": []}

    def snap(what: str) -> dict:
        with open("/proc/self/statm") as fh:
            f = fh.read().split()
        rss, shared = int(f[1]) * page, int(f[2]) * page
        mi = libc.mallinfo2()
        return {"what": what, "t": round(time.perf_counter() - t0, 4), "rss": rss, "file": shared,
                "anon": rss - shared, "heap": mi.arena, "heap_used": mi.uordblks, "heap_free": mi.fordblks,
                "heap_top_free": mi.keepcost, "mmapped": mi.hblkhd, "mmapped_n": mi.hblks}

    def run() -> None:
        high, last = 0, 0.0
        patched = False
        while True:
            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * page
            now = time.perf_counter()
            if rss > high:
                high = rss
                trace["peak"] = snap("peak")
            if now - last > 0.1:
                last = now
                trace["series"].append(snap("tick"))
            if not patched:
                patched = _patch(trace, snap)
            time.sleep(0.002)

    def dump() -> None:
        trace["marks"].append(snap("exit"))
        with open(_OUT, "w") as fh:
            json.dump(trace, fh)

    trace["marks"].append(snap("start"))
    threading.Thread(target=run, daemon=True).start()
    atexit.register(dump)


def _patch(trace: dict, snap) -> bool:
    import sys

    mod = sys.modules.get("transformers.trainer")
    if mod is None or not hasattr(mod, "Trainer"):
        return False
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_train_begin(self, *a, **k):
            trace["marks"].append(snap("train_begin"))

        def on_step_begin(self, args, state, *a, **k):
            trace["marks"].append(snap(f"step_begin {state.global_step + 1}"))

        def on_step_end(self, args, state, *a, **k):
            trace["marks"].append(snap(f"step_end {state.global_step}"))

    original = mod.Trainer.train

    def train(self, *a, **k):
        self.add_callback(Marks())
        return original(self, *a, **k)

    mod.Trainer.train = train
    return True


if _OUT:
    _start()
