"""``memfit calibrate --hardware`` and the silent first-use calibration of ``--gpus local``.

The planning commands stay torch-free once the profile is cached: only a missing (or ignored) profile
imports torch, once per machine (``MEMFIT_HWCAL=off`` keeps the uncalibrated model and never measures).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from memfit.cli.output import err_console


def _disabled() -> bool:
    return os.environ.get("MEMFIT_HWCAL", "").lower() in ("off", "0", "no", "false")


def with_local_rates(hw: Any, quiet: bool = False) -> Any:
    """``hw`` with this machine's measured speeds when it is the local pool: the cached profile, or one
    measured now (silently, ~20 s, once per machine). A corrupt or foreign cache file gives one note."""
    if getattr(hw, "label", "") not in ("local", "auto") or _disabled():
        return hw
    if hw.rates_note and not quiet:
        err_console.print(f"[yellow]note:[/yellow] {hw.rates_note}", highlight=False)
    if hw.rates is not None:
        return hw
    try:
        from memfit.measure.hwcal import ensure_hardware_profile
    except ImportError:  # no torch on this machine: the catalog model, named as such
        return hw
    rates, _ = ensure_hardware_profile(force=bool(hw.rates_note))
    return dataclasses.replace(hw, rates=rates, rates_note="")


def refresh_local_profile(max_age: float, say=None) -> bool:
    """Measure this machine again when its newest calibration is older than ``max_age`` seconds (or none is
    cached): for a run whose predicted step is compared with its measured one (``memfit demo``). True when
    it measured. Nothing with MEMFIT_HWCAL=off or without torch."""
    import time

    if _disabled():
        return False
    try:
        from memfit.measure.hwcal import ensure_hardware_profile
    except ImportError:
        return False
    from memfit.spec import hwprofile
    from memfit.spec.hardware import local_fingerprint

    cached, _ = hwprofile.load_cached(local_fingerprint())
    newest = float(cached.measured_unix) if cached is not None else 0.0  # the newest calibration's time
    age = time.time() - newest
    if cached is not None and newest and age <= max_age:
        return False
    if say is not None:
        when = f"{age / 3600:.1f} h old" if cached is not None and newest else "absent or undated"
        say(f"measuring this machine (~15 s): its hardware profile is {when}, and the summary compares the "
            "predicted step with this run's")
    ensure_hardware_profile(force=True)
    return True


def calibrate_hardware_cmd(force: bool, json_: bool) -> None:
    """Measure (or show the cached) hardware profile of this machine."""
    from memfit.cli.output import console, print_json
    from memfit.measure.hwcal import ensure_hardware_profile
    from memfit.spec import hwprofile
    from memfit.spec.hardware import local_fingerprint

    fp = local_fingerprint()
    _, note = hwprofile.load_cached(fp)
    if note:
        err_console.print(f"[yellow]note:[/yellow] {note}", highlight=False)

    def progress(line: str) -> None:
        if not json_:
            err_console.print(f"calibrating this machine {line}", highlight=False)
    rates, fresh = ensure_hardware_profile(force=force or bool(note), progress=progress)
    path = hwprofile.profile_path(fp)
    if json_:
        print_json({"profile": str(path), "measured_now": fresh, **rates.to_dict()})
        return
    console.print(summary_lines(rates, path, fresh), highlight=False)


def summary_lines(rates: Any, path: Any, fresh: bool) -> str:
    g = lambda v: f"{v / 1e9:.3g}"  # noqa: E731
    keys = [k for k in rates.gemm if k != "device"] or ["device"]
    lines = [f"hardware profile {path} ({'measured now' if fresh else 'cached'}, {rates.basis}, "
             f"{rates.device}, {rates.cores} cores, took {rates.took_seconds:.1f} s)"]
    for k in keys:
        where = "device" if k == "device" else f"{k} thread(s)"
        for dt, row in rates.gemm[k].items():
            lines.append(f"  GEMM {dt:5s} {where}: " + "  ".join(f"{c} {g(row[c])}" for c in
                                                               ("small", "medium", "large", "skinny") if c in row)
                         + " GFLOP/s")
        att = rates.attention[k]
        lines.append(f"  attention {where}: " + "  ".join(
            f"{kind} {dt} " + ("/".join(f"{g(r)} (s={s})" for s, r in sorted(v.items(), key=lambda x: int(x[0])))
                                 if isinstance(v, dict) else g(v))
            for kind in ("eager", "sdpa") for dt, v in att[kind].items()) + " GFLOP/s")
        lines.append(f"  bandwidth {where}: {g(rates.bandwidth[k])} GB/s")
    lines.append(f"  one small op (forward + backward): {rates.op_seconds * 1e6:.1f} us")
    bw = rates.bandwidth or {}
    extra = [f"{label} {float(bw[key]) * scale:{fmt}} {unit}" for key, label, scale, fmt, unit in (
        ("first_touch_s_per_byte", "first touch", 1e12, ".0f", "us/MB"),
        ("dropout_s_per_value", "dropout", 1e9, ".1f", "ns/value")) if bw.get(key)]
    if extra:
        lines.append("  " + ", ".join(extra) + " (1 thread)")
    for world, c in (rates.collectives or {}).items():
        lines.append(f"  all-reduce, {world} processes ({c['backend']}): {g(c['bus_bytes_per_s'])} GB/s bus, "
                     f"latency {c['latency_s'] * 1e6:.0f} us")
        if c.get("concurrency"):
            lines.append(f"  {world} processes at once: each {c['concurrency']['gemm']:.2f}x slower on GEMMs, "
                         f"{c['concurrency']['ops']:.2f}x on small ops")
    for way, v in (rates.copies or {}).items():
        lines.append(f"  pinned copy {way}: {g(v)} GB/s")
    return "\n".join(lines)
