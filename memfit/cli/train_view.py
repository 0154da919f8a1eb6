"""Formatting for ``memfit train`` / ``memfit demo``: the final summary (predicted beside measured) and the
plan line. Plain Python and rich; no torch."""

from __future__ import annotations

from typing import Any, Optional

from rich.table import Table

from memfit.cli.output import console, human_bytes


def _find(d: Any, *names: str) -> Optional[float]:
    """The first numeric value under one of ``names`` in a (nested) estimate dict."""
    if not isinstance(d, dict):
        return None
    for n in names:
        v = d.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    for v in d.values():
        if isinstance(v, dict):
            found = _find(v, *names)
            if found is not None:
                return found
    return None


def predicted_figures(pred: Optional[dict]) -> tuple[Optional[float], Optional[float]]:
    """(peak memory bytes, step time s) from an ``Estimate.to_dict()``."""
    if not pred:
        return None, None
    try:  # the estimate --json contract
        return float(pred["memory"]["gpu_bytes"]["total"]), float(pred["time"]["step_seconds"])
    except (KeyError, TypeError, ValueError):
        pass
    peak = _find(pred, "peak_bytes", "total_bytes", "device_peak_bytes", "gpu_peak_bytes", "peak")
    step = _find(pred, "step_time_s", "step_seconds", "step_s", "seconds_per_step")
    return peak, step


def predicted_process_ram(pred: Optional[dict]) -> Optional[float]:
    """One process's RAM on the CPU device, as the planner predicts it: its "device" lines (tensors + glibc's heap
    holes, memory.gpu_bytes.total) + its share of the node's process and offload lines (cpu_bytes.total) —
    memfit.estimate.host.node_ram per process. What a process's peak RSS measures (#39)."""
    try:
        mem, procs = pred["memory"], int(pred["hardware"]["gpus_per_node"]) or 1
        return float(mem["gpu_bytes"]["total"]) + float(mem["cpu_bytes"]["total"]) / procs
    except (KeyError, TypeError, ValueError):
        return None


def _ratio(measured: Optional[float], predicted: Optional[float]) -> str:
    if not measured or not predicted:
        return ""
    return f"{(predicted - measured) / measured * 100:+.0f}%"


def summary_table(r: Any) -> Table:
    """The final summary of a TrainResult (or its dict)."""
    d = r.to_dict() if hasattr(r, "to_dict") else dict(r)
    t = Table(title=f"memfit train — {d['method']} — {d['steps']} steps", show_header=True,
              header_style="bold")
    t.add_column("")
    t.add_column("measured", justify="right")
    t.add_column("predicted", justify="right")
    t.add_column("pred. vs meas.", justify="right")
    first, final = d.get("first_loss"), d.get("final_loss")
    if first is not None and final is not None:
        t.add_row("train loss (first → last)", f"{first:.4f} → {final:.4f}", "", "")
    if d.get("eval_loss") is not None:
        t.add_row("eval loss", f"{d['eval_loss']:.4f}", "", "")
    p_peak, p_step = predicted_figures(d.get("predicted"))
    kind = "peak RSS (process)" if d["peak_mem_kind"] == "peak_rss" else "peak allocated (CUDA)"
    rss = d["peak_mem_kind"] == "peak_rss"  # the whole process: compared with the process's predicted RAM
    if rss:
        p_peak = predicted_process_ram(d.get("predicted")) or p_peak
    t.add_row(f"peak memory, {kind}", human_bytes(d["peak_mem_bytes"]),
              (human_bytes(p_peak) + (" (process RAM)" if rss else "")) if p_peak else "—",
              _ratio(d["peak_mem_bytes"], p_peak))
    step = d.get("step_time_s")
    as_ran = d.get("predicted_step") or {}
    if as_ran.get("shape") == "padded":  # measured, then predicted at the batches' padded lengths and as planned
        t.add_row("step time (median)", f"{step * 1000:.1f} ms" if step else "—", "", "")
        t.add_row(f"  predicted at padded length {as_ran['padded']['median_len']:g}", "",
                  f"{as_ran['step_seconds'] * 1000:.1f} ms", _ratio(step, as_ran["step_seconds"]))
        t.add_row(f"  predicted at planned {as_ran['planned_shape']}", "",
                  f"{p_step * 1000:.1f} ms" if p_step else "—", _ratio(step, p_step))
    else:
        t.add_row("step time (median)", f"{step * 1000:.1f} ms" if step else "—",
                  f"{p_step * 1000:.1f} ms" if p_step else "—", _ratio(step, p_step))
    if d.get("tokens_per_s"):
        t.add_row("tokens/s", f"{d['tokens_per_s']:.0f}", "", "")
    m = d.get("model") or {}
    if m:
        t.add_row("parameters (trainable / all)", f"{m['trainable']:,} / {m['params']:,}", "", "")
    data = d.get("data") or {}
    if data:
        t.add_row("examples (train / eval)", f"{data['train_examples']} / {data['eval_examples']}", "", "")
        t.add_row("truncated examples (tokens cut)", f"{data['truncated']} ({data['tokens_cut']})", "", "")
    return t


def print_summary(r: Any) -> None:
    d = r.to_dict() if hasattr(r, "to_dict") else dict(r)
    console.print(summary_table(d))
    if d.get("peak_mem_kind") == "peak_rss":
        console.print("[dim]On CPU the measured peak is the whole process's RSS; the prediction beside it is the "
                      "process's RAM as the planner counts it (tensors + glibc's heap holes + the process "
                      "baseline); `memfit measure RUN.yaml` also compares the tensors at the allocator level.[/dim]")
    if not d.get("predicted"):
        console.print("[dim]No prediction: the planner (memfit.estimate) gave none for this model here.[/dim]")
    else:
        as_ran = d.get("predicted_step") or {}
        time_basis = (d["predicted"].get("time") or {}).get("basis")
        shape = as_ran.get("basis") or "at the planned shape"
        console.print(f"[dim]predicted step time: {shape}" + (f"; {time_basis}" if time_basis else "")
                      + "[/dim]")
        if as_ran.get("memory_basis"):
            console.print(f"[dim]predicted peak memory: {as_ran['memory_basis']}[/dim]")
    for note in d.get("notes") or []:
        console.print(f"[yellow]note:[/yellow] {note}")
    if d.get("resumed_from"):
        console.print(f"resumed from {d['resumed_from']}")
    if d.get("saved_to"):
        console.print(f"saved: [bold]{d['saved_to']}[/bold]")
    console.print(f"metrics: {d['metrics_file']}")
    if d.get("report"):
        console.print(f"report: {d['report']}", highlight=False, soft_wrap=True)
