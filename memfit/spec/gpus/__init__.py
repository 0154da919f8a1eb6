"""One record per GPU kind, one JSON file each (like the model presets): the memory CUDA gives a process with
its source, the data-sheet peaks and links the planner's catalog reads (memfit.spec.hardware) and the speeds
the time model prices with (memfit.steptime.devices: SMs, memory bandwidth, the best achievable matmul and
attention fractions, peer-to-peer). Adding a kind is adding a file. Plain Python, read once."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent


@lru_cache(maxsize=1)
def records() -> tuple[dict, ...]:
    """Every kind's record, in the catalog's order (its ``order`` field)."""
    out = [json.loads(p.read_text()) for p in HERE.glob("*.json")]
    return tuple(sorted(out, key=lambda r: r["order"]))
