"""The tables behind the page's pictures (pandas DataFrames, which Gradio's native plots draw).

Every number is read from the planner's own objects (Estimate, Plan, Matrix, GpuCountResult); nothing is
recomputed. Sizes are decimal GB, as ``memfit plan`` prints them.
"""

from __future__ import annotations

from typing import Any

FREE = "free"
MARGIN = "margin"
OTHER = "other"
# one fixed colour per memory line (the estimator's gpu_bytes keys); a line not named here is drawn as "other"
COLORS = {"weights": "#4c78a8", "gradients": "#f58518", "optimizer": "#e45756", "activations": "#72b7b2",
          "logits": "#54a24b", "lora_intermediates": "#eeca3b", "meft_buffers": "#b279a2",
          "gathered_params": "#ff9da6", "comm_buffers": "#9d755d", "step_temporaries": "#bab0ac",
          "overhead": "#6f4e7c", OTHER: "#393b79", FREE: "#e8e8e8", MARGIN: "#c4c4c4"}
# the legend's entries, bottom of a bar first (the smaller lines are named on hover)
LEGEND = ["weights", "gradients", "optimizer", "activations", "logits", "lora_intermediates", "overhead", FREE,
          MARGIN]


def _frame(rows: list[dict], columns: list[str]) -> Any:
    import pandas as pd

    return pd.DataFrame(rows, columns=columns)


def _label(est: Any) -> str:
    from memfit.plan.matrix import short_label

    return short_label(est.strategy)


def shown_plans(plan: Any, most: int = 4) -> list[Any]:
    """The recommended plan and the runner-ups ``plan`` names (one per method x engine x checkpointing)."""
    shown, seen = [], set()
    for est in plan.candidates:
        s = est.strategy
        key = (s.method, s.engine, s.gradient_checkpointing)
        if key in seen:
            continue
        seen.add(key)
        shown.append(est)
        if len(shown) == most:
            break
    return shown


def _segments(est: Any) -> list[tuple[str, float]]:
    """The per-GPU memory lines (bytes) that add up to the total held against the card. The estimator's
    negative lines (what is not alive at the peak at once) are netted out of the largest line, so the stack's
    height is the total."""
    lines = {k: v for k, v in est.gpu.items() if k != "total" and v}
    positive = {k: v for k, v in lines.items() if v > 0}
    negative = sum(v for v in lines.values() if v < 0)
    if negative and positive:
        largest = max(positive, key=positive.get)
        positive[largest] += negative
    return list(positive.items())


def memory_bars(plan: Any, most: int = 4) -> Any:
    """Stacked bars: per shown plan, its memory lines, then what is left usable and the margin, so each bar
    reaches the card's capacity. Columns: plan, component, GB, note."""
    rows = []
    capacity = float(plan.hardware.gpu.memory_bytes)
    for rank, est in enumerate(shown_plans(plan, most), 1):
        name = f"{rank}. {_label(est)}" + (" ★" if rank == 1 else "")
        usable = float(est.usable_gpu_bytes)
        total = float(est.gpu_total)
        note = f"total {total / 1e9:.2f} GB of {capacity / 1e9:.2f} GB (usable {usable / 1e9:.2f})"
        # listed top of the bar first: the page's stacked bars draw the first series on top
        # the cache the allocator frees on demand may reach into the margin (the verdict holds less than the total)
        rows.append({"plan": name, "component": MARGIN, "GB": max(capacity - max(usable, total), 0.0) / 1e9,
                     "note": note})
        rows.append({"plan": name, "component": FREE, "GB": max(usable - total, 0.0) / 1e9, "note": note})
        for component, value in reversed(_segments(est)):
            component = component if component in COLORS else OTHER
            rows.append({"plan": name, "component": component, "GB": value / 1e9, "note": note})
    return _frame(rows, ["plan", "component", "GB", "note"])


SCATTER_COLUMNS = ["combination", "strategy", "verdict", "s/step", "GB/GPU", "tokens/s", "CPU GB"]


def _point(est: Any, verdict: str) -> dict:
    return {"combination": _label(est), "strategy": est.strategy.label(), "verdict": verdict,
            "s/step": est.step_seconds, "GB/GPU": est.gpu_total / 1e9,
            "tokens/s": est.tokens_per_second, "CPU GB": est.cpu_total / 1e9}


def time_memory(plan: Any) -> Any:
    """Every combination the planner priced: those that fit and those over memory (a combination a rule
    refused has no numbers)."""
    rows = [_point(est, "fits") for est in plan.candidates]
    rows += [_point(r.estimate, "does not fit") for r in plan.rejected
             if r.kind == "memory" and r.estimate is not None]
    return _frame(rows, SCATTER_COLUMNS)


def runner_ups(plan: Any, top: int = 8) -> Any:
    """The fastest combinations that fit, as ``memfit plan``'s table lists them."""
    rows = []
    for i, est in enumerate(plan.candidates[:top], 1):
        rows.append({"#": i, "combination": est.strategy.label(), "s/step": round(est.step_seconds, 4),
                     "tokens/s": round(est.tokens_per_second),
                     "GB/GPU": round(est.gpu_total / 1e9, 2), "CPU GB": round(est.cpu_total / 1e9, 2)})
    return _frame(rows, ["#", "combination", "s/step", "tokens/s", "GB/GPU", "CPU GB"])


def matrix_table(m: Any) -> Any:
    """One row per model, one column per sequence length: the compact label of the fastest that fits."""
    rows = []
    for model, labels in zip(m.models, m.rows()):
        rows.append({"model": model, **{str(s): label for s, label in zip(m.seq_lens, labels)}})
    return _frame(rows, ["model"] + [str(s) for s in m.seq_lens])


COUNT_COLUMNS = ["GPUs", "fastest that fits", "s/step", "tokens/s", "GB/GPU", "CPU GB", "steps", "hours",
                 "cost", "best"]


def count_table(result: Any) -> Any:
    """The GPU-count search: per count, the fastest that fits, its step time, memory, run time and cost."""
    best = result.best
    rows = []
    for r in result.rows:
        rec = r.recommended
        if rec is None:
            rows.append({"GPUs": r.gpus, "fastest that fits": "nothing fits"})
            continue
        rows.append({"GPUs": r.gpus, "fastest that fits": _label(rec), "s/step": round(rec.step_seconds, 4),
                     "tokens/s": round(rec.tokens_per_second),
                     "GB/GPU": round(rec.gpu_total / 1e9, 2), "CPU GB": round(rec.cpu_total / 1e9, 2),
                     "steps": r.steps, "hours": None if r.hours is None else round(r.hours, 2),
                     "cost": None if r.cost is None else round(r.cost, 2), "best": "▶" if r is best else ""})
    return _frame(rows, COUNT_COLUMNS)


def memory_bars_empty() -> Any:
    return _frame([], ["plan", "component", "GB", "note"])


def time_memory_empty() -> Any:
    return _frame([], SCATTER_COLUMNS)


def runner_ups_empty() -> Any:
    return _frame([], ["#", "combination", "s/step", "tokens/s", "GB/GPU", "CPU GB"])
