"""The noise floor of published figures: configurations a source measured more than once (other days, other
library versions) and how far apart the repeats are. No median error below that spread means what it seems to.
"""

from __future__ import annotations

import json
import statistics


def config_key(model: str, hardware, strategy, extra: str = "") -> str:
    """One configuration: the model, the GPUs as laid out, every strategy key, and what the figure measures."""
    return json.dumps([model, hardware.gpu.name, hardware.gpus_per_node, hardware.nodes,
                       strategy.model_dump(mode="json"), extra], sort_keys=True, default=str)


def floor(pairs) -> dict:
    """``pairs``: (configuration key, measured value). The configurations with two or more measurements, and the
    spread of each (largest / smallest - 1): how many, median and largest spread in %."""
    by: dict[str, list[float]] = {}
    for key, value in pairs:
        if value:
            by.setdefault(key, []).append(float(value))
    spreads = [max(v) / min(v) - 1.0 for v in by.values() if len(v) >= 2]
    if not spreads:
        return {"configs": 0, "median_spread_pct": None, "max_spread_pct": None}
    return {"configs": len(spreads), "measurements": sum(len(v) for v in by.values() if len(v) >= 2),
            "median_spread_pct": round(100 * statistics.median(spreads), 1),
            "max_spread_pct": round(100 * max(spreads), 1)}
