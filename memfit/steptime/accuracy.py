"""The GPU time model's measured error on published GPU throughputs, by kind of run (written by
``bench/gpu_time_fit.py --write``; plain JSON beside this module, read once). Each run is predicted with the
fitted constants refitted without its source group; each range carries its ``basis`` (``held_out`` only where
nothing was decided after seeing those rows, else ``development``: bench/provenance.json) and the hand-set
constants it rests on. ``bench/gpu_time_fit.py --check`` (run by the tests) fails when the file is stale."""

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
    """{'kind', 'rows', 'min_pct', 'max_pct', 'median_abs_pct', 'basis', 'hand_set', 'overall': {...}} for
    catalog-GPU step times of this kind (error = predicted tokens/s / published − 1), or None when no
    published run of the kind could be expressed (then 'overall' alone, under kind None)."""
    data = _data()
    if not data:
        return None
    overall = {k: data.get(k) for k in ("rows", "median_abs_pct", "max_abs_pct", "basis", "hand_set", "rests_on")}
    hit = data.get("kinds", {}).get(kind)
    base = {"procedure": data.get("procedure"), "overall": overall, "noise_floor": data.get("noise_floor"),
            "held_out_readings": data.get("held_out_readings", []), "command": data.get("command")}
    return {"kind": kind, **hit, **base} if hit else {"kind": None, **base}


def basis_text(err: dict) -> str:
    """'held out' / 'development: N choices made seeing these rows' / 'in-sample' (the bar's ``basis``)."""
    basis = err.get("basis")
    if basis == "held_out":
        return "held out: nothing chosen after seeing these rows"
    if basis == "development":
        n = err.get("rests_on") or 0
        return f"development: {n} choice{'s' if n != 1 else ''} made seeing these rows"
    return "in-sample"


def readings_text(err: dict) -> str:
    """The held-out figure: new sources scored once at a frozen commit (bench/holdout/ledger.json)."""
    reads = err.get("held_out_readings") or []
    if not reads:
        return ""
    first = "; ".join(f"median {r['first']['median_abs_pct']:.1f} %, max {r['first']['max_abs_pct']:.1f} % on "
                      f"{r['first']['figures']} figures" for r in reads)
    return f". Held out on {len(reads)} new source{'s' if len(reads) != 1 else ''} scored once: {first}"


def noise_text(err: dict) -> str:
    floor = err.get("noise_floor") or {}
    if not floor.get("configs"):
        return ""
    return (f"; repeats of one configuration differ by median {floor['median_spread_pct']:.1f} %, up to "
            f"{floor['max_spread_pct']:.1f} %")


def describe_time(err: Optional[dict]) -> str:
    if not err:
        return "no published GPU throughput to check against yet"
    o = err["overall"]
    every = (f"full/LoRA/QLoRA/DoRA runs: median {o['median_abs_pct']:.0f} %, max {o['max_abs_pct']:.0f} % on "
             f"{o['rows']} runs ({basis_text(o)}{noise_text(err)}){readings_text(err)}")
    if err.get("kind") is None:
        return f"no published run of this kind; {every}"
    return (f"{err['kind']}: {err['min_pct']:+.0f}…{err['max_pct']:+.0f} % tokens/s on {err['rows']} published "
            f"run{'s' if err['rows'] != 1 else ''}, median {err['median_abs_pct']:.0f} % ({basis_text(err)}"
            f"{_hand_set(err)}); {every}")


def _hand_set(err: dict) -> str:
    n = len(err.get("hand_set") or [])
    return f", {n} of them hand-set constants (--json: hand_set)" if n else ""
