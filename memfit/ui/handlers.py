"""What the page's controls call. Plain functions of plain values (what Gradio passes), so the tests call
them directly. A user mistake (any MemfitError) comes back as an inline message in ``message``; anything
else is caught too and shown as one line, so the page never shows a traceback or goes dead."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from memfit.errors import MemfitError
from memfit.ui import charts
from memfit.ui.form import Form

# the form's controls, in the order the page passes them
FIELDS = ("source", "preset", "folder", "config_text", "config_file", "gpu", "count", "nodes", "custom_gb",
          "cpu_ram_gb", "seq_len", "micro_batch", "grad_accum", "methods", "margin", "sequence_parallel",
          "context_parallel", "activation_offload", "tiled_mlp", "liger")


def form_of(*values: Any) -> Form:
    """A Form from the controls' values in FIELDS order."""
    kw = dict(zip(FIELDS, values))
    upload = kw.get("config_file")
    if upload is not None and not isinstance(upload, str):  # a file object with .name (older Gradio)
        kw["config_file"] = getattr(upload, "name", None)
    return Form(**kw)


def message_of(err: BaseException) -> str:
    """One line for the page: a user mistake as memfit words it; anything else named, without a traceback."""
    if isinstance(err, MemfitError):
        return f"error: {' '.join(str(err).split())}"
    return f"error: internal error ({type(err).__name__}: {' '.join(str(err).split())[:300]})"


def guarded(fn: Callable[[], Any], empty: Any) -> tuple[str, Any]:
    """(message, result): ('', fn()) or (the error's line, empty)."""
    try:
        return "", fn()
    except Exception as err:  # noqa: BLE001 -- the page shows every failure as one line
        return message_of(err), empty


@dataclass
class PlanOutput:
    """Everything the planning view shows for one state of the form."""

    message: str = ""
    headline: str = ""
    text: str = ""
    bars: Any = None
    scatter: Any = None
    runner_ups: Any = None
    files: list = field(default_factory=list)
    command: str = ""
    plan: Optional[dict] = None      # memfit plan --json's object
    seconds: float = 0.0             # the planner's time for this answer

    def as_tuple(self) -> tuple:
        """What the page's answer shows first (the downloads follow: :func:`files_page`)."""
        return (self.message, self.headline, self.text, self.bars, self.scatter, self.runner_ups, self.command)


def _empty() -> PlanOutput:
    return PlanOutput(bars=charts.memory_bars_empty(), scatter=charts.time_memory_empty(),
                      runner_ups=charts.runner_ups_empty())


_RECENT: dict[str, Any] = {}  # the last few plans by question, so the downloads that follow an answer reuse it
_KEEP = 8


def _remember(key: str, result: Any) -> None:
    _RECENT.pop(key, None)
    _RECENT[key] = result
    while len(_RECENT) > _KEEP:
        _RECENT.pop(next(iter(_RECENT)))


def _answer(form: Form, workdir: Path, key: str, files: bool) -> PlanOutput:
    from memfit.ui import compute, text

    result = compute.run_plan(form, workdir)
    _remember(key, result)
    d = result.to_dict()
    written = compute.emit_files(result, workdir, d) if files else []
    n_rule = sum(1 for r in result.plan.rejected if r.kind == "rule")
    command = result.command or ("(a custom memory size has no `memfit plan` flag: the command line and "
                                 "run.yaml take catalog GPUs only)")
    if result.plan.recommended is None:
        command = (result.command or "").replace(" --emit run-config/", "") or command
    return PlanOutput(
        headline=text.headline(d), text=text.recommendation(d, result.hardware.text(), result.seconds, n_rule),
        bars=charts.memory_bars(result.plan), scatter=charts.time_memory(result.plan),
        runner_ups=charts.runner_ups(result.plan), files=[str(p) for p in written], command=command, plan=d,
        seconds=result.seconds)


def plan_page(workdir: Path, *values: Any, files: bool = True) -> PlanOutput:
    """The planning view for the form's values; a bad input gives ``message`` and empty views.
    ``files=False``: without writing the downloads (the page fetches them next, with :func:`files_page`)."""
    key = repr(values)
    message, out = guarded(lambda: _answer(form_of(*values), Path(workdir), key, files), None)
    if out is None:
        out = _empty()
        out.message = message
    return out


def files_page(workdir: Path, *values: Any) -> list[str]:
    """The downloads for the form's values (``plan --emit``'s files, plan.json, command.txt); [] when the
    inputs are wrong (the answer shows why) or nothing fits."""
    from memfit.ui import compute

    def run() -> list[str]:
        result = _RECENT.get(repr(values)) or compute.run_plan(form_of(*values), Path(workdir))
        return [str(p) for p in compute.emit_files(result, Path(workdir))]

    return guarded(run, [])[1]


def matrix_page(*values: Any) -> tuple[str, Any]:
    """(message, the model x context table for the chosen pool)."""
    from memfit.ui import compute

    return guarded(lambda: charts.matrix_table(compute.matrix_for(form_of(*values))), None)


def count_page(workdir: Path, max_gpus: Any, price: Any, tokens: Any, *values: Any) -> tuple[str, Any]:
    """(message, the GPU-count / time / cost table for the chosen model and GPU kind)."""
    from memfit.ui import compute
    from memfit.ui.form import whole

    def run() -> Any:
        n = whole(max_gpus, "largest GPU count")
        cost = None if price in (None, "") or price == 0 else float(price)
        total = None if tokens in (None, "", 0) else whole(tokens, "tokens to train on")
        return charts.count_table(compute.gpu_counts(form_of(*values), Path(workdir), n, cost, total))

    return guarded(run, None)


def runs_page(folder: Any) -> tuple[str, Any, list]:
    """(message, the runs table, the run folders for the picker)."""
    from memfit.ui import runs

    def run() -> tuple[Any, list]:
        rows = runs.find_runs(folder)
        import pandas as pd

        table = pd.DataFrame([{"run": r.path, "strategy": r.strategy, "steps": r.steps,
                               "final loss": r.final_loss, "report.html": "yes" if r.has_report else "not yet"}
                              for r in rows], columns=["run", "strategy", "steps", "final loss", "report.html"])
        return table, [r.path for r in rows]

    message, got = guarded(run, (None, []))
    if not message and not got[1]:
        message = f"no run folders (with summary.json) under {folder}"
    return message, got[0], got[1]


def report_page(run_dir: Any) -> tuple[str, str]:
    """(message or the report's path, the report in a frame)."""
    from memfit.ui import runs

    if not run_dir:
        return "pick a run", ""
    message, got = guarded(lambda: runs.report_html(run_dir), None)
    if got is None:
        return message, ""
    page, note = got
    return f"report: {note}", runs.frame(page)
