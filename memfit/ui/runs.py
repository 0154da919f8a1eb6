"""Run folders under a folder, and their ``report.html`` (memfit.train.report) shown inside the page.

A run folder is one holding ``summary.json`` (what ``memfit train`` writes at the end). A run without a
report yet gets one drawn by memfit.train.report.write_report (the ``[plot]`` extra), as ``memfit report``
does. The page shows the report in a sandboxed frame (``srcdoc``): it is self-contained, so nothing else
is served.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from memfit.errors import ConfigError

MAX_DEPTH = 3
MAX_RUNS = 200


@dataclass
class RunRow:
    path: str
    strategy: str
    steps: Optional[int]
    final_loss: Optional[float]
    has_report: bool


def _row(d: Path) -> RunRow:
    from memfit.train.report import REPORT_FILE, SUMMARY_FILE

    try:
        summary = json.loads((d / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    summary = summary if isinstance(summary, dict) else {}
    pred = summary.get("predicted") if isinstance(summary.get("predicted"), dict) else {}
    strategy = pred.get("strategy") if isinstance(pred.get("strategy"), dict) else {}
    try:
        from memfit.spec.strategy import Strategy

        label = Strategy(**strategy).label()
    except (TypeError, ValueError):  # pydantic's ValidationError is a ValueError
        label = str(summary.get("method", "?"))
    steps = summary.get("steps") if isinstance(summary.get("steps"), int) else None
    loss = summary.get("final_loss") if isinstance(summary.get("final_loss"), (int, float)) else None
    return RunRow(str(d), label, steps, loss, (d / REPORT_FILE).is_file())


def find_runs(folder: str) -> list[RunRow]:
    """The run folders at most three levels under ``folder`` (itself included), newest first."""
    from memfit.train.report import SUMMARY_FILE

    root = Path(str(folder or "").strip() or ".").expanduser()
    if not root.is_dir():
        raise ConfigError(f"runs folder {root}: no such folder; give the folder your runs are written to "
                          "(e.g. runs)")
    found = [root] if (root / SUMMARY_FILE).is_file() else []
    for depth in range(1, MAX_DEPTH + 1):
        found += [p.parent for p in root.glob("/".join(["*"] * depth) + "/" + SUMMARY_FILE)]
    found = sorted(set(found), key=lambda p: (p / SUMMARY_FILE).stat().st_mtime, reverse=True)
    return [_row(d) for d in found[:MAX_RUNS]]


def report_html(run_dir: str) -> tuple[str, str]:
    """(the run's report.html text, a one-line note). Draws the report first when the run has none."""
    from memfit.train.report import REPORT_FILE, check_run_dir, plot_available, write_report

    d = check_run_dir(str(run_dir or "").strip() or ".")
    page = d / REPORT_FILE
    note = f"{page}"
    if not page.is_file():
        if not plot_available():
            raise ConfigError(f"{d} has no {REPORT_FILE} and drawing one needs matplotlib: "
                              "pip install 'memfit[plot]'")
        write_report(d)
        note = f"{page} (drawn now, as `memfit report {d}` does)"
    return page.read_text(encoding="utf-8"), note


def frame(page: str, height: int = 900) -> str:
    """The report inside a sandboxed iframe (its scripts off; it needs none)."""
    return (f'<iframe id="memfit-report-frame" title="memfit report" sandbox="allow-same-origin" '
            f'style="width:100%;height:{height}px;border:1px solid #ccc;background:#fff" '
            f'srcdoc="{html.escape(page, quote=True)}"></iframe>')
