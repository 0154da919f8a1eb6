"""Memory probes: what a training step really used, per metric, named.

Three metrics, never mixed up:

* **allocated** — the allocator-level peak of torch tensors on one device. On CUDA this is
  ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved`` for the caching allocator's
  reservation). On CPU torch keeps no counters, so the probe runs the PyTorch profiler with
  ``profile_memory=True`` and replays its memory timeline (which also sorts every live tensor into a
  category: parameters, gradients, optimizer state, activations, temporaries). A second, independent
  figure comes from the raw allocation events plus a baseline of storages that were live at the start.
* **reserved** — CUDA only: what the caching allocator holds from the driver.
* **RSS** — the process's resident set peak (``VmHWM``), reset at the start of the window where Linux
  allows it (``/proc/self/clear_refs``). It includes the interpreter, libraries and memory glibc keeps.

The profiler pieces are private torch APIs (torch.profiler._memory_profiler); torch is pinned and the
probe is tested against known allocation patterns.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from memfit.steptime.cpu import GLIBC_MMAP_THRESHOLD_MAX, GLIBC_SETTLED_TRIM_THRESHOLD

# profiler category -> memfit component name (the keys of measured["components"]).
_CATEGORY_NAMES = {
    "PARAMETER": "parameters",
    "GRADIENT": "gradients",
    "OPTIMIZER_STATE": "optimizer_state",
    "ACTIVATION": "activations",
    "TEMPORARY": "temporaries",
    "AUTOGRAD_DETAIL": "autograd_detail",
    "INPUT": "inputs",
    None: "unattributed",
}
COMPONENTS: tuple[str, ...] = (
    "parameters", "gradients", "optimizer_state", "activations", "logits", "temporaries",
    "autograd_detail", "inputs", "unattributed",
)


# --------------------------------------------------------------------------- RSS
def _status_field(name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (Linux ``clear_refs`` 5). False where the OS does not allow it, or
    accepts the write but the peak it reports stays above the resident set (a sandbox's no-op)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    hwm, rss = _status_field("VmHWM"), _status_field("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + (16 << 20)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (since start or the last ``reset_peak_rss``)."""
    hwm = _status_field("VmHWM")
    if hwm is not None:
        return hwm
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru if sys.platform == "darwin" else ru * 1024


def current_rss_bytes() -> int:
    rss = _status_field("VmRSS")
    return rss if rss is not None else peak_rss_bytes()


# --------------------------------------------------------------------------- live storages
def live_storage_bytes(tensors: Optional[Iterable[Any]] = None, device: str = "cpu") -> int:
    """Bytes of the distinct storages behind ``tensors`` (default: every tensor the GC can see) on ``device``.

    Views share a storage and count once. Tensors held only by C++ (autograd graph) are not visible to the
    GC scan; call this between steps, when none should exist.
    """
    dev = torch.device(device)
    if tensors is None:
        tensors = (o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2 shards): count this rank's shard
        if isinstance(local, torch.Tensor):
            t = local
        if t.device.type != dev.type or t.is_meta:
            continue
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError):  # sparse / wrapper subclasses / freed (FSDP) storage
            continue
        if ptr:
            seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
    return sum(seen.values())


# --------------------------------------------------------------------------- the probe
@dataclass
class ProbeResult:
    """One probe window on one device."""

    device: str
    peak_allocated_bytes: int
    components: dict[str, int] = field(default_factory=dict)
    method: str = "profiler-timeline"
    raw_events_peak_bytes: Optional[int] = None
    baseline_bytes: Optional[int] = None
    peak_reserved_bytes: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class TensorMemoryProbe:
    """Peak tensor memory of everything run inside the window, with a breakdown by category at the peak.

    ``with TensorMemoryProbe() as probe: step()`` then ``probe.result()``. ``logits_bytes`` (optional)
    is a predicate on a tensor's byte size that marks it as logits (the output layer's b·s·V tensors),
    split out of activations/temporaries. ``baseline`` lists tensors live before the window (params,
    optimizer state) for the raw-event figure; default: a GC scan.
    """

    def __init__(self, device: str = "cpu", *, categories: bool = True,
                 logits_bytes: Optional[Callable[[int], bool]] = None,
                 baseline: Optional[Callable[[], Iterable[Any]]] = None) -> None:
        self.device = str(torch.device(device))
        self.categories = categories
        self.logits_bytes = logits_bytes
        self._baseline_fn = baseline
        self._prof = None
        self._result: Optional[ProbeResult] = None
        self._baseline = 0
        self._baseline_parts: dict[str, int] = {}

    @property
    def _cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def start(self) -> "TensorMemoryProbe":
        from torch.profiler import ProfilerActivity, profile

        gc.collect()
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            src = self._baseline_fn() if self._baseline_fn else None
            if isinstance(src, dict):  # {component: tensors}: also a breakdown for the raw-event figure
                self._baseline_parts = {k: live_storage_bytes(v, self.device) for k, v in src.items()}
                self._baseline = sum(self._baseline_parts.values())
            else:
                self._baseline = live_storage_bytes(src, self.device)
        activities = [ProfilerActivity.CPU]
        if self._cuda:
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, profile_memory=True,
                             record_shapes=self.categories, with_stack=self.categories)
        self._prof.__enter__()
        return self

    def stop(self) -> ProbeResult:
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(None, None, None)
        results = self._prof.profiler.kineto_results
        raw = self._baseline + _raw_event_peak(results, self.device)
        # raw events carry no categories: what was live at the start (by kind) + the rest
        raw_parts = _rescale({k: v for k, v in self._baseline_parts.items() if v}, raw)
        res = None
        if self.categories:
            try:
                res = _timeline_peak(results, self.device, self.logits_bytes)
            except Exception as err:  # private API: fall back to the raw events, say so
                res = ProbeResult(self.device, raw, raw_parts,
                                  method=f"raw-events (timeline failed: {type(err).__name__})")
        if res is None:
            res = ProbeResult(self.device, raw, raw_parts, method="raw-events")
        elif res.method == "profiler-timeline":
            res.components = _claim_baseline(res.components, self._baseline_parts)
        res.raw_events_peak_bytes = raw
        res.baseline_bytes = self._baseline
        if self._cuda:
            # the CUDA allocator's own counters are the reference figure on GPU
            alloc = torch.cuda.max_memory_allocated(self.device)
            res.components = _rescale(res.components, alloc)
            res.peak_allocated_bytes = alloc
            res.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
            res.method = "torch.cuda.max_memory_allocated (+profiler categories)"
        self._prof = None
        self._result = res
        return res

    def __enter__(self) -> "TensorMemoryProbe":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        if self._prof is not None:
            self.stop()

    def result(self) -> ProbeResult:
        if self._result is None:
            raise RuntimeError("probe window not closed yet")
        return self._result


def _rescale(components: dict[str, int], total: int) -> dict[str, int]:
    """Put the difference between the counter's total and the categorised sum in 'unattributed'."""
    out = dict(components)
    out["unattributed"] = out.get("unattributed", 0) + total - sum(components.values())
    return out


def _claim_baseline(components: dict[str, int], parts: dict[str, int]) -> dict[str, int]:
    """Where the timeline could not categorise model states (e.g. FSDP's sharded DTensors), move what
    was known live at the start from 'unattributed' to its component. The sum is unchanged."""
    out = dict(components)
    for name, known in parts.items():
        missing = known - out.get(name, 0)
        take = min(max(missing, 0), out.get("unattributed", 0))
        if take > 0:
            out[name] = out.get(name, 0) + take
            out["unattributed"] -= take
    return out


def _raw_event_peak(results: Any, device: str) -> int:
    """Highest running sum of the allocation events inside the window (bytes allocated minus freed), with the
    frees the profiler cannot see (another thread's: gloo's) restored: memfit.measure.alloc_events."""
    from memfit.measure.alloc_events import raw_event_peak

    return raw_event_peak(results, device)


def _timeline_peak(results: Any, device: str,
                   logits_bytes: Optional[Callable[[int], bool]]) -> ProbeResult:
    """Replay the profiler's memory timeline; the total's peak and the live categories at that moment."""
    from torch.profiler._memory_profiler import Action, MemoryProfile, TensorKey

    dev = torch.device(device)
    mp = MemoryProfile(results)
    cats = mp._categories
    timeline = [e for e in mp.timeline if e[2][0].device.type == dev.type]

    def category(key: Any, version: int) -> str:
        c = cats.get(key, version) if isinstance(key, TensorKey) else None
        return _CATEGORY_NAMES.get(c.name if c is not None else None, "unattributed")

    # pass 1: where is the peak (after the last event sharing a timestamp)
    total = peak = 0
    peak_index = -1
    for i, (t, action, _, nbytes) in enumerate(timeline):
        if action in (Action.PREEXISTING, Action.CREATE):
            total += nbytes
        elif action == Action.DESTROY:
            total -= nbytes
        nxt = timeline[i + 1][0] if i + 1 < len(timeline) else None
        if total > peak and nxt != t:
            peak, peak_index = total, i
    # pass 2: what was live at the peak
    live: dict[Any, tuple[str, int]] = {}
    for t, action, (key, version), nbytes in timeline[: peak_index + 1]:
        ident = (key, getattr(key, "id", None), getattr(key, "storage", None))
        if action in (Action.PREEXISTING, Action.CREATE):
            live[ident] = (category(key, version), nbytes)
        elif action == Action.INCREMENT_VERSION:
            if ident in live:
                live[ident] = (category(key, version + 1), live[ident][1])
        elif action == Action.DESTROY:
            live.pop(ident, None)
    comps = {name: 0 for name in COMPONENTS}
    for cat, nbytes in live.values():
        if logits_bytes is not None and cat in ("activations", "temporaries", "autograd_detail",
                                                "unattributed") and logits_bytes(nbytes):
            cat = "logits"
        comps[cat] += nbytes
    live_total = sum(comps.values())
    if live_total != peak:  # keys reused across versions: keep the breakdown summing to the total
        comps["unattributed"] += peak - live_total
    return ProbeResult(device, peak, comps, method="profiler-timeline")


# --------------------------------------------------------------------------- CUDA process figures
def cuda_context_bytes(device: Any = None) -> Optional[int]:
    """Driver-level memory this process uses beyond the caching allocator (context, kernels, NCCL).

    ``mem_get_info`` sees the whole GPU, so this is exact only when the process is alone on it.
    """
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def env_for_measurement(base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Environment for a measured subprocess: glibc returns freed blocks, so RSS tracks tensors closer."""
    env = dict(os.environ if base is None else base)
    from memfit.measure.compare import MEASURE_MMAP_THRESHOLD

    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MEASURE_MMAP_THRESHOLD))
    return env


# glibc mallopt parameters (malloc/malloc.h): M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def settles_malloc() -> bool:
    """Whether this process runs under ``env_for_measurement``'s 64 KiB mmap threshold (tight RSS: every
    tensor from 64 KiB a fresh mapping, page-faulted on first touch, +50-90 % step time), so that its timed
    steps should run after :func:`settle_malloc`."""
    from memfit.measure.compare import MEASURE_MMAP_THRESHOLD

    return sys.platform.startswith("linux") and \
        os.environ.get("MALLOC_MMAP_THRESHOLD_") == str(MEASURE_MMAP_THRESHOLD)


def settle_malloc() -> Optional[int]:
    """Once the RSS is measured, give glibc the state a training process settles in — mmap threshold at its
    32 MiB ceiling, trim at twice it (malloc.c raises both as it frees) — so the timed steps run as the
    user's run does. The threshold set, or None where nothing changed (not :func:`settles_malloc`, no glibc)."""
    if not settles_malloc():
        return None
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX) and \
            libc.mallopt(_M_TRIM_THRESHOLD, GLIBC_SETTLED_TRIM_THRESHOLD)
    except (OSError, AttributeError):
        return None
    return GLIBC_MMAP_THRESHOLD_MAX if ok else None
