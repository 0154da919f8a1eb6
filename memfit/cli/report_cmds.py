"""CLI command ``report``: a finished run folder as one self-contained ``report.html`` (registered by
memfit.cli.app). Thin: memfit.train.report reads, draws and writes; this prints what it holds."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def print_report(r) -> None:
    """The report's numbers as a table, then where it was written."""
    from rich.table import Table

    from memfit.cli.output import console, human_bytes

    t = Table(title=f"memfit report — {r.strategy} — {r.steps} steps", header_style="bold")
    for col, just in (("", "left"), ("measured", "right"), ("predicted", "right"), ("pred. vs meas.", "right")):
        t.add_column(col, justify=just)
    if r.first_loss is not None and r.final_loss is not None:
        t.add_row("train loss (first → last)", f"{r.first_loss:.4f} → {r.final_loss:.4f}", "", "")
    if r.eval_loss is not None:
        t.add_row("eval loss", f"{r.eval_loss:.4f}", "", "")
    st = r.step_time
    meas = st.get("measured_step_s")
    for key, label in (("predicted_step_s", "step time, as run"), ("planned_step_s", "step time, as planned")):
        if key in st:
            t.add_row(label, f"{meas * 1000:.1f} ms" if meas else "—", f"{st[key] * 1000:.1f} ms",
                      f"{(st[key] - meas) / meas * 100:+.0f}%" if meas else "")
    for m in r.memory:
        p, q = m["predicted_bytes"], m["measured_bytes"]
        t.add_row(f"memory: {m['component']}", human_bytes(q) if q is not None else "",
                  human_bytes(p) if p is not None else "—",
                  f"{m['error_pct']:+.1f}%" if m["error_pct"] is not None else "")
    console.print(t)
    console.print(f"report: [bold]{r.report_file}[/bold]", highlight=False, soft_wrap=True)


def report_command(
    run_dir: Path = typer.Argument(..., help="A finished run folder (the output_dir of memfit train)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to write the page (default "
                                       "RUN_DIR/report.html)."),
    as_json: bool = typer.Option(False, "--json", help="Print what the report holds (paths and numbers) "
                                 "as JSON instead of the table."),
) -> None:
    """Write one self-contained report.html for a run: loss, learning rate, step time, memory, the plan."""
    from memfit.cli.extras import require

    require("report", "plot")
    from memfit.train.report import write_report

    r = write_report(run_dir, out)
    if as_json:
        from memfit.cli.output import print_json

        print_json(r.to_dict())
    else:
        print_report(r)


def register(app: typer.Typer) -> None:
    """Add ``report`` to ``app``."""
    app.command("report")(report_command)
