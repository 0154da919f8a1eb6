"""The estimator's measured error on published GPU runs, by kind of run (data written by
``bench/gpu_published.py --write-accuracy``; plain JSON beside this module, read once)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Optional

DATA = Path(__file__).resolve().parent / "published_accuracy.json"


def run_kind(method: str, zero_stage: int, fsdp, offload: str, world: int) -> str:
    """e.g. 'qlora, 1 GPU', 'lora, ZeRO-3', 'full, FSDP + offload'."""
    if fsdp:
        engine = "FSDP"
    elif zero_stage:
        engine = "ZeRO-3" if zero_stage == 3 else "ZeRO-1/2"
    else:
        engine = "1 GPU" if world == 1 else "DDP"
    return f"{method}, {engine}" + (" + offload" if offload != "none" else "")


@lru_cache(maxsize=1)
def _table() -> dict:
    try:
        return json.loads(DATA.read_text()).get("kinds", {})
    except (OSError, ValueError):
        return {}


def published_error(kind: str) -> Optional[dict]:
    """{'kind', 'figures', 'min_pct', 'max_pct', 'median_abs_pct', 'source'} or None when no published run of
    this kind could be expressed."""
    hit = _table().get(kind)
    return None if hit is None else {"kind": kind, **hit, "source": "bench/gpu_published.py"}


def describe(err: Optional[dict]) -> str:
    if not err:
        return "no measured GPU run of this kind to check against yet"
    return (f"{err['kind']}: within {err['min_pct']:+.1f}…{err['max_pct']:+.1f} % on {err['figures']} measured GPU "
            f"figure{'s' if err['figures'] != 1 else ''} (published runs + memfit's GPU check)")
