"""Measured against predicted, component by component and in total (plain Python, no torch).

The estimate's memory components (``memory.gpu_bytes``: weights, gradients, optimizer, activations,
logits, overhead, total) are matched with the probe's categories. Every figure keeps the name of its
metric: the comparison is against the **allocated** peak (allocator level); reserved (CUDA) and RSS are
reported beside it, never mixed in. RSS is compared per node, like the estimator's ``cpu_bytes``: with
several ranks, the sum of their peak RSS. On a GPU pool the predicted RSS is ``cpu_bytes.total``; on the CPU
pseudo-device, whose "device" is the host's RAM, it is every process's device lines + ``cpu_bytes.total``
(:func:`memfit.estimate.host.node_ram`, the planner's fits-check figure).
"""

from __future__ import annotations

from typing import Any, Optional

from memfit.estimate.host import node_ram

# the measured processes' glibc mmap threshold (memfit.measure.probe.env_for_measurement): every freed block
# over 64 KiB is unmapped, so glibc's brk heap keeps no holes of freed tensors
MEASURE_MMAP_THRESHOLD = 65536
CPU_POOL = "CPU"  # the CPU pseudo-device's name in the hardware catalog (memfit.spec.hardware)

# estimate component -> probe categories that make it up
COMPONENT_MAP: dict[str, tuple[str, ...]] = {
    "weights": ("parameters",),
    "gradients": ("gradients",),
    "optimizer": ("optimizer_state",),
    "activations": ("activations", "autograd_detail", "inputs"),
    "logits": ("logits",),
    "overhead": ("temporaries", "unattributed"),
}


def error_pct(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """(predicted − measured) / measured in percent; None when either side is missing or measured is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return round(100.0 * (float(predicted) - float(measured)) / float(measured), 2)


def measured_by_component(components: dict[str, int]) -> dict[str, int]:
    """The probe's categories folded into the estimate's component names."""
    return {name: sum(int(components.get(c, 0)) for c in cats) for name, cats in COMPONENT_MAP.items()}


# estimate lines folded into the compared components (lines absent from an estimate count 0; lines not
# listed here are added to overhead)
PREDICTED_MAP: dict[str, tuple[str, ...]] = {
    "weights": ("weights", "gathered_params"),
    "gradients": ("gradients",),
    "optimizer": ("optimizer",),
    "activations": ("activations", "lora_intermediates", "meft_buffers"),
    "logits": ("logits",),
    "overhead": ("overhead", "comm_buffers"),
}


def cpu_pool(predicted: dict[str, Any]) -> bool:
    """Whether the estimate is for the CPU pseudo-device (its "device" lines live in the host's RAM)."""
    return ((predicted or {}).get("hardware") or {}).get("gpu") == CPU_POOL


def predicted_memory(predicted: dict[str, Any]) -> dict[str, float]:
    """The per-device memory components of an ``Estimate.to_dict()``, folded as PREDICTED_MAP says.

    On the CPU pseudo-device the allocated figures leave out glibc's heap holes (the overhead line's
    ``allocator_fragmentation``): freed memory, in RSS under glibc's defaults, never in the tensor peak."""
    mem = (predicted or {}).get("memory", {})
    gpu = mem.get("gpu_bytes") or mem.get("per_gpu_bytes") or {}
    lines = {k: float(v) for k, v in gpu.items() if isinstance(v, (int, float))}
    if not lines:
        return {}
    heap = 0.0
    if cpu_pool(predicted):
        heap = float((mem.get("gpu_overhead_bytes") or {}).get("allocator_fragmentation", 0))
    for key in ("overhead", "total"):
        if key in lines:
            lines[key] -= heap
    out = {name: sum(lines.get(k, 0.0) for k in keys) for name, keys in PREDICTED_MAP.items()}
    mapped = {k for keys in PREDICTED_MAP.values() for k in keys} | {"total"}
    # lines this table does not know (e.g. step temporaries, concurrency corrections) are overhead, so
    # the folded components still add up to the estimate's total
    extra = {k: v for k, v in lines.items() if k not in mapped}
    out["overhead"] += sum(v for v in extra.values() if v > 0)
    # negative lines are the estimator's "not all live at once" corrections: no measured counterpart
    out["correction"] = sum(v for v in extra.values() if v < 0)
    if "total" in lines:
        out["total"] = lines["total"]
    return out


def node_rss(measured: dict[str, Any]) -> tuple[Optional[int], str]:
    """(measured peak RSS of the node, metric label), comparable with the estimator's per-node
    ``cpu_bytes.total``: the sum of the ranks' peak RSS when several processes ran (each rank's peak,
    so an upper bound of the simultaneous total), else the one process's peak RSS."""
    per_rank = [r["peak_rss_bytes"] for r in measured.get("ranks") or [] if r.get("peak_rss_bytes") is not None]
    if len(per_rank) > 1:
        return int(sum(per_rank)), f"RSS, sum of {len(per_rank)} ranks"
    if measured.get("peak_rss_bytes") is not None:
        return int(measured["peak_rss_bytes"]), "RSS"
    return None, "RSS"


def heap_holes_resident(measured: dict[str, Any]) -> bool:
    """Whether glibc kept the holes of freed tensors resident in the measured processes: yes under its
    defaults (``malloc_mmap_threshold`` None) or a threshold above 64 KiB, no with memfit measure's 65536
    (records without the field were measured with it)."""
    t = measured.get("malloc_mmap_threshold", MEASURE_MMAP_THRESHOLD)
    return t is None or int(t) > MEASURE_MMAP_THRESHOLD


def predicted_rss(predicted: dict[str, Any], measured: dict[str, Any]) -> tuple[Optional[float], str, str]:
    """(predicted peak RSS of the node's processes, the row's label, a note) — comparable with
    :func:`node_rss`. GPU pools: ``cpu_bytes.total`` (baseline, loading, offload). The CPU pseudo-device:
    :func:`~memfit.estimate.host.node_ram` — each process's device lines (tensors; + glibc's heap holes, the
    estimate's ``allocator_fragmentation``, only where the measured processes kept them) + ``cpu_bytes.total``."""
    mem = (predicted or {}).get("memory", {})
    host = mem.get("cpu_bytes", {}).get("total")
    hw = (predicted or {}).get("hardware") or {}
    procs = int(hw.get("gpus_per_node") or 1)
    if host is None or not cpu_pool(predicted) or mem.get("gpu_bytes", {}).get("total") is None:
        return host, "processes" if len(measured.get("ranks") or []) > 1 else "process", ""
    heap = float(mem.get("gpu_overhead_bytes", {}).get("allocator_fragmentation", 0))
    holes = heap_holes_resident(measured)
    device = float(mem["gpu_bytes"]["total"]) - (0.0 if holes else heap)
    tensors = "tensors + heap" if holes else "tensors"
    label = f"{tensors} + process" if procs == 1 else (
        f"{procs} × " + (f"({tensors})" if holes else tensors) + " + processes")
    note = "" if holes or not heap else (
        f"RSS: glibc's heap holes ({heap / 1e6:.0f} MB per process under its defaults) not counted, measured "
        f"with MALLOC_MMAP_THRESHOLD_={measured.get('malloc_mmap_threshold', MEASURE_MMAP_THRESHOLD)}")
    return node_ram(procs, device, float(host)), label, note


def predicted_step_seconds(predicted: dict[str, Any]) -> Optional[float]:
    t = (predicted or {}).get("time", {}).get("step_seconds")
    return float(t) if isinstance(t, (int, float)) else None


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """``error_pct`` for the total (vs the allocated peak), each component (None where the measured
    component is under 1 % of the peak), and step time.

    Also returns ``rows``: one dict per line of the human table (component, metric, predicted, measured,
    error_pct).
    """
    pred = predicted_memory(predicted)
    meas = measured_by_component(measured.get("components") or {})
    rows = []
    errors: dict[str, Optional[float]] = {}
    peak = measured.get("peak_allocated_bytes") or 0
    for name in COMPONENT_MAP:
        p, m = pred.get(name), meas.get(name)
        if p is None and not m:
            continue
        # a component under 1 % of the measured peak gives a meaningless ratio: no error for it
        errors[name] = error_pct(p, m) if m and m >= 0.01 * peak else None
        rows.append({"component": name, "metric": "allocated", "predicted": p, "measured": m,
                     "error_pct": errors[name]})
    if pred.get("correction"):
        rows.append({"component": "not live at the peak", "metric": "allocated", "predicted": pred["correction"],
                     "measured": None, "error_pct": None})
    total_p, total_m = pred.get("total"), measured.get("peak_allocated_bytes")
    errors["total"] = error_pct(total_p, total_m)
    rows.append({"component": "total", "metric": "allocated", "predicted": total_p, "measured": total_m,
                 "error_pct": errors["total"]})
    if measured.get("peak_reserved_bytes") is not None:
        rows.append({"component": "total", "metric": "reserved", "predicted": total_p,
                     "measured": measured["peak_reserved_bytes"],
                     "error_pct": error_pct(total_p, measured["peak_reserved_bytes"])})
    rss_m, rss_metric = node_rss(measured)
    if rss_m is not None:
        # the estimate's RSS figures are per node (every process on it): compared with the ranks' sum
        rss_p, label, note = predicted_rss(predicted, measured)
        errors["rss"] = error_pct(rss_p, rss_m)
        rows.append({"component": label, "metric": rss_metric, "predicted": rss_p, "measured": rss_m,
                     "error_pct": errors["rss"], **({"note": note} if note else {})})
    t_p, t_m = predicted_step_seconds(predicted), measured.get("step_seconds")
    errors["step_seconds"] = error_pct(t_p, t_m)
    rows.append({"component": "step time", "metric": "seconds", "predicted": t_p, "measured": t_m,
                 "error_pct": errors["step_seconds"]})
    return {"error_pct": errors, "rows": rows}


def summarize(errors: list[Optional[float]]) -> dict[str, Optional[float]]:
    """Median and max of |error %| over a grid (None entries skipped)."""
    vals = sorted(abs(e) for e in errors if e is not None)
    if not vals:
        return {"n": 0, "median_abs_pct": None, "max_abs_pct": None}
    mid = len(vals) // 2
    median = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
    return {"n": len(vals), "median_abs_pct": round(median, 2), "max_abs_pct": round(vals[-1], 2)}
