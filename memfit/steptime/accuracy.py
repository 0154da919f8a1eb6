"""The GPU time model's measured error on published GPU throughputs, by kind of run (written by
``bench/gpu_time_fit.py --write``; plain JSON beside this module, read once). Held out: each run predicted
with the fitted constants refitted without its source group. ``bench/gpu_time_fit.py --check`` (run by the
tests) fails when the file is stale."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

from memfit.io import read_json_or_empty

DATA = Path(__file__).resolve().parent / "published_time_accuracy.json"


@lru_cache(maxsize=1)
def _data() -> dict:
    return read_json_or_empty(DATA)


def published_time_error(kind: str) -> Optional[dict]:
    """{'kind', 'rows', 'min_pct', 'max_pct', 'median_abs_pct', 'held_out', 'basis', 'overall': {...}} for
    catalog-GPU step times of this kind (error = predicted tokens/s / published − 1), or None when no
    published run of the kind could be expressed (then 'overall' alone, under kind None)."""
    data = _data()
    if not data:
        return None
    overall = {"rows": data.get("rows"), "median_abs_pct": data.get("median_abs_pct"),
               "max_abs_pct": data.get("max_abs_pct")}
    hit = data.get("kinds", {}).get(kind)
    base = {"held_out": bool(data.get("held_out")), "basis": data.get("basis"), "overall": overall,
            "command": data.get("command")}
    return {"kind": kind, **hit, **base} if hit else {"kind": None, **base}


def describe_time(err: Optional[dict]) -> str:
    if not err:
        return "no published GPU throughput to check against yet"
    held = "held out" if err.get("held_out") else "in-sample"
    o = err["overall"]
    every = (f"full/LoRA/QLoRA/DoRA runs: median {o['median_abs_pct']:.0f} %, max {o['max_abs_pct']:.0f} % on "
             f"{o['rows']} runs")
    if err.get("kind") is None:
        return f"no published run of this kind; {every} ({held})"
    return (f"{err['kind']}: {err['min_pct']:+.0f}…{err['max_pct']:+.0f} % tokens/s on {err['rows']} published "
            f"run{'s' if err['rows'] != 1 else ''}, median {err['median_abs_pct']:.0f} % ({held}); {every}")
