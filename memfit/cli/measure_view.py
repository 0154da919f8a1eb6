"""Rich tables for ``memfit measure`` and ``memfit calibrate`` (formatting only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rich.table import Table

from memfit.cli.output import console, human_bytes


def _fmt(value: Optional[float], metric: str) -> str:
    if value is None:
        return "—"
    if metric == "seconds":
        return f"{value:.3f} s"
    return human_bytes(value)


def _err(e: Optional[float]) -> str:
    if e is None:
        return "—"
    colour = "green" if abs(e) <= 5 else "yellow" if abs(e) <= 15 else "red"
    return f"[{colour}]{e:+.1f} %[/{colour}]"


def show_record(rec: dict[str, Any]) -> None:
    """Component by component: predicted vs measured, each figure with its metric."""
    m = rec["measured"]
    s = rec["run"]["strategy"]
    title = (f"{rec['label']}  seq {s['seq_len']}  micro-batch {s['micro_batch_size']}  "
             f"device {m.get('device')}  ranks {len(m.get('ranks') or [])}")
    t = Table(title=title, title_justify="left")
    for col, just in (("component", "left"), ("metric", "left"), ("predicted", "right"),
                      ("measured", "right"), ("error", "right")):
        t.add_column(col, justify=just)
    for row in rec["rows"]:
        t.add_row(row["component"], row["metric"], _fmt(row["predicted"], row["metric"]),
                  _fmt(row["measured"], row["metric"]), _err(row["error_pct"]))
    console.print(t)
    if rec.get("predicted") is None:
        console.print("[dim]no prediction: the estimator (memfit.estimate) is not available[/dim]")
    notes = [f"allocated = allocator-level peak of torch tensors ({m.get('method')}); "
             "error = (predicted − measured) / measured"]
    if m.get("peak_reserved_bytes") is None:
        notes.append("reserved: CUDA only")
    notes += [row["note"] for row in rec["rows"] if row.get("note")]
    if m.get("cuda_context_bytes") is not None:
        notes.append(f"CUDA context {human_bytes(m['cuda_context_bytes'])}")
    if rec.get("saved_to"):
        notes.append(f"saved {rec['saved_to']}")
    console.print("[dim]" + "; ".join(notes) + "[/dim]")


def show_sweep(records: list[dict[str, Any]]) -> None:
    from memfit.measure.compare import node_rss, predicted_memory, summarize

    t = Table(title="sweep: allocated peak, predicted vs measured", title_justify="left")
    for col in ("configuration", "seq", "mb", "predicted", "measured (allocated)", "error",
                "RSS peak (node)", "step"):
        t.add_column(col, justify="left" if col == "configuration" else "right",
                     overflow="fold", min_width=18 if col == "configuration" else None)
    for rec in records:
        m, s = rec["measured"], rec["run"]["strategy"]
        pred = predicted_memory(rec.get("predicted") or {}).get("total")
        t.add_row(rec["label"], str(s["seq_len"]), str(s["micro_batch_size"]), _fmt(pred, "bytes"),
                  _fmt(m["peak_allocated_bytes"], "bytes"), _err(rec["error_pct"].get("total")),
                  _fmt(node_rss(m)[0], "bytes"), _fmt(m.get("step_seconds"), "seconds"))
    console.print(t)
    s = summarize([r["error_pct"].get("total") for r in records])
    if s["n"]:
        console.print(f"|error| on the allocated peak: median {s['median_abs_pct']:.1f} %, "
                      f"max {s['max_abs_pct']:.1f} % over {s['n']} configurations")


def show_calibration(reports: list[dict[str, Any]], path: Path, n: int, before: Optional[dict] = None,
                     after: Optional[dict] = None) -> None:
    t = Table(title=f"calibration from {n} measurements", title_justify="left")
    for col in ("target", "constant", "before", "after"):
        t.add_column(col, justify="left" if col in ("target", "constant") else "right")
    for rep in reports:
        for name, value in rep["fitted"].items():
            t.add_row(rep["target"], name, f"{rep['before'][name]:.4g}", f"{value:.4g}")
    console.print(t)
    for rep in reports:
        console.print(f"{rep['target']} ({rep['n']} runs): RMS error {rep['rms_error_pct_before']:.2f} % → "
                      f"{rep['rms_error_pct_after']:.2f} % (max {rep['max_error_pct_after']:.2f} %)"
                      + (f"; not identifiable from these runs: {', '.join(rep['not_identifiable'])}"
                         if rep["not_identifiable"] else ""))
    if before and after and before.get("n"):
        console.print(f"allocated peak over the {before['n']} runs: median |error| {before['median_abs_pct']} % → "
                      f"{after['median_abs_pct']} %, max {before['max_abs_pct']} % → {after['max_abs_pct']} %")
    console.print(f"wrote {path}  (use: memfit plan ... --profile {path})")


def show_traces(items: list[dict[str, Any]]) -> None:
    from memfit.measure.compare import predicted_memory

    t = Table(title="traced step (FakeTensorMode, no compute) vs the analytical estimate", title_justify="left")
    for col in ("configuration", "seq", "mb", "traced peak (allocated)", "predicted", "predicted vs traced"):
        t.add_column(col, justify="left" if col == "configuration" else "right", overflow="fold")
    for it in items:
        total = predicted_memory(it.get("predicted") or {}).get("total")
        t.add_row(it["label"], str(it["seq_len"]), str(it["micro_batch_size"]),
                  _fmt(it["traced"]["peak_bytes"], "bytes"), _fmt(total, "bytes"),
                  _err(it["error_pct"]["total_vs_traced"]))
    console.print(t)
    console.print("[dim]traced = live tensor storages of one real training step of this architecture run on "
                  "fake tensors (CPU kernels); model states included[/dim]")
