"""``memfit report RUN_DIR``: one self-contained ``report.html`` for a finished run folder.

The page opens offline: its style is inline, its figures are inline SVG drawn with matplotlib (the
``[plot]`` extra, imported only when a report is drawn), and nothing points outside the file. It shows
loss and eval loss, learning rate, step time and tokens/s by step (from ``metrics.jsonl``), the
predicted-vs-measured memory by component and step time, the strategy and hardware, and the reasons the
summary holds for the plan (from ``summary.json``). Every string read from the run folder is escaped.

Library code: :func:`load_report` reads and checks a run folder (a mistake is one ConfigError line naming
the file and, for ``metrics.jsonl``, the line), :func:`render_html` draws the page, :func:`write_report`
writes it atomically (memfit.io), so a failure leaves the folder as it was. Nothing here prints.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from memfit.errors import ConfigError
from memfit.io import reason, write_text
from memfit.train.report_html import render_html

REPORT_FILE = "report.html"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
PLOT_INSTALL = "pip install 'memfit[plot]'"

# what metrics.jsonl's train lines (those with "loss") and eval lines (with "eval_loss") are drawn from
TRAIN_SERIES = ("loss", "learning_rate", "step_time_s", "tokens_per_s", "grad_norm")
EVAL_SERIES = ("eval_loss",)


def plot_available() -> bool:
    """True where matplotlib (the ``[plot]`` extra) can be imported; nothing is imported to find out."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


@dataclass
class Report:
    """What a report holds: the paths and the numbers (``memfit report --json`` prints ``to_dict()``)."""

    run_dir: str
    report_file: str
    summary_file: str
    metrics_file: str
    method: Optional[str]
    strategy: str                                   # the strategy's label, e.g. lora+ddp+sdpa
    levers: dict = field(default_factory=dict)      # the strategy's main levers
    hardware: dict = field(default_factory=dict)
    steps: Optional[int] = None
    first_loss: Optional[float] = None
    final_loss: Optional[float] = None
    eval_loss: Optional[float] = None
    series: dict = field(default_factory=dict)      # name -> [[step, value], ...] from metrics.jsonl
    memory: list = field(default_factory=list)      # rows: component, predicted_bytes, measured_bytes, ...
    memory_measured_kind: Optional[str] = None      # peak_rss | cuda_max_allocated
    step_time: dict = field(default_factory=dict)   # measured / predicted step seconds and tokens/s
    reasons: list = field(default_factory=list)     # why this plan, as the summary holds it
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------ reading the run folder
def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise ConfigError(f"cannot read {path}: it is a folder, not a file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"cannot read {path}: not UTF-8 text (byte {err.start}); the file is damaged") from None
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {reason(err)}") from None


def _number(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def check_run_dir(run_dir: Any) -> Path:
    """The run folder, or one ConfigError line saying why it is not one."""
    d = Path(run_dir).expanduser()
    hint = "give the output_dir of a `memfit train` run (e.g. runs/demo)"
    if not d.exists():
        raise ConfigError(f"{d}: no such folder; {hint}")
    if not d.is_dir():
        raise ConfigError(f"{d} is a file, not a folder; {hint}")
    has_summary, has_metrics = (d / SUMMARY_FILE).exists(), (d / METRICS_FILE).exists()
    if not has_summary and not has_metrics:
        raise ConfigError(f"{d} is not a memfit run folder: no {SUMMARY_FILE} or {METRICS_FILE}; {hint}")
    if not has_summary:
        raise ConfigError(f"{d} holds no {SUMMARY_FILE}: the run has not finished (interrupted or still "
                          f"running); resume it with `memfit train {d / 'run.yaml'} --resume`, then report")
    if not has_metrics:
        raise ConfigError(f"{d} holds no {METRICS_FILE} beside {SUMMARY_FILE}; the report draws the run's "
                          "logs from it")
    return d


def read_summary(path: Path) -> dict:
    try:
        data = json.loads(_read_text(path))
    except ValueError as err:
        line = f", line {err.lineno}" if hasattr(err, "lineno") else ""
        raise ConfigError(f"{path}: not valid JSON{line}; the file is damaged (a new run writes it "
                          "again)") from None
    if not isinstance(data, dict) or not ("steps" in data or "method" in data):
        raise ConfigError(f"{path}: not a memfit run summary (a JSON object with steps, method, ...)")
    return data


def read_metrics(path: Path) -> list[dict]:
    """The lines of ``metrics.jsonl``; a line that is not a JSON object with a step number is an error
    naming the line number (blank lines are skipped)."""
    rows = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ConfigError(f"{path}:{n}: not a JSON line; the file is damaged (fix or delete line {n})") \
                from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{n}: a JSON object expected, got {type(row).__name__}")
        if _number(row.get("step")) is None:
            raise ConfigError(f"{path}:{n}: no step number (each line needs \"step\": N)")
        rows.append(row)
    return rows


def series(rows: list[dict]) -> dict[str, list[list[float]]]:
    """name -> [[step, value], ...] sorted by step; one value per step (the last logged)."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        names = TRAIN_SERIES if "loss" in row else EVAL_SERIES if "eval_loss" in row else ()
        for name in names:
            v = _number(row.get(name))
            if v is not None:
                out.setdefault(name, {})[int(row["step"])] = v
    return {k: [[s, v] for s, v in sorted(d.items())] for k, d in out.items()}


# ------------------------------------------------------------------ what the summary says
def _label(strategy: dict, fallback: str) -> str:
    from memfit.spec.strategy import Strategy

    try:
        return Strategy.model_validate(strategy).label()
    except Exception:  # another memfit version's keys: the method alone
        return fallback


LEVERS = ("method", "zero_stage", "fsdp", "offload", "gradient_checkpointing", "attention", "precision",
          "optimizer", "micro_batch_size", "grad_accum", "seq_len", "loss", "lora_r")


def _run_file_strategy(run_dir: Path) -> dict:
    try:
        import yaml

        data = yaml.safe_load((run_dir / "run.yaml").read_text(encoding="utf-8"))
        return data.get("strategy") or {} if isinstance(data, dict) else {}
    except Exception:  # optional: the summary's prediction is the main source
        return {}


def memory_rows(summary: dict) -> list[dict]:
    """Predicted-vs-measured memory: every predicted component, then the figures a training run measures
    (the CUDA allocator's peak against the predicted tensors on a GPU; on CPU the process's peak RSS
    against the predicted tensors + the process baseline, as `memfit measure` compares them)."""
    pred = summary.get("predicted") if isinstance(summary.get("predicted"), dict) else {}
    mem = pred.get("memory") if isinstance(pred.get("memory"), dict) else {}
    comps = mem.get("gpu_bytes") if isinstance(mem.get("gpu_bytes"), dict) else {}
    kinds = mem.get("gpu_line_kinds") if isinstance(mem.get("gpu_line_kinds"), dict) else {}
    rows = []
    for name, v in comps.items():
        v = _number(v)
        if name != "total" and v:
            rows.append({"component": str(name), "predicted_bytes": v, "measured_bytes": None,
                         "kind": str(kinds.get(name, "")), "row": "component"})
    measured = _number(summary.get("peak_mem_bytes"))
    kind = summary.get("peak_mem_kind")
    allocated = _number(mem.get("gpu_allocated_bytes"))
    if allocated is not None or (measured is not None and kind == "cuda_max_allocated"):
        rows.append({"component": "allocated (tensors)", "predicted_bytes": allocated,
                     "measured_bytes": measured if kind == "cuda_max_allocated" else None,
                     "kind": "torch max_memory_allocated", "row": "total"})
    total = _number(comps.get("total"))
    if total is not None:
        rows.append({"component": "total per GPU (held against the card)", "predicted_bytes": total,
                     "measured_bytes": None, "kind": str(mem.get("held_against_capacity") or ""),
                     "row": "total"})
    if kind == "peak_rss" and measured is not None:
        cpu = mem.get("cpu_bytes") if isinstance(mem.get("cpu_bytes"), dict) else {}
        base = _number(cpu.get("process_baseline"))
        rows.append({"component": "tensors + process (peak RSS)",
                     "predicted_bytes": allocated + base if allocated is not None and base is not None else None,
                     "measured_bytes": measured, "kind": "the whole process on CPU", "row": "total"})
    for r in rows:
        p, m = r["predicted_bytes"], r["measured_bytes"]
        r["error_pct"] = round((p - m) / m * 100, 1) if p is not None and m else None
    return rows


def step_time(summary: dict) -> dict:
    pred = summary.get("predicted") if isinstance(summary.get("predicted"), dict) else {}
    t = pred.get("time") if isinstance(pred.get("time"), dict) else {}
    as_ran = summary.get("predicted_step") if isinstance(summary.get("predicted_step"), dict) else {}
    out = {
        "measured_step_s": _number(summary.get("step_time_s")),
        "predicted_step_s": _number(as_ran.get("step_seconds")),
        "predicted_basis": as_ran.get("basis"),
        "planned_step_s": _number(t.get("step_seconds")),
        "planned_shape": as_ran.get("planned_shape"),
        "time_basis": t.get("basis"),
        "measured_tokens_per_s": _number(summary.get("tokens_per_s")),
        "planned_tokens_per_s": _number(t.get("tokens_per_second")),
    }
    return {k: v for k, v in out.items() if v is not None}


def hardware(summary: dict) -> dict:
    pred = summary.get("predicted") if isinstance(summary.get("predicted"), dict) else {}
    hw = pred.get("hardware") if isinstance(pred.get("hardware"), dict) else {}
    model = summary.get("model") if isinstance(summary.get("model"), dict) else {}
    out = {k: hw[k] for k in ("gpu", "gpus_per_node", "nodes", "gpu_memory_bytes", "cpu_ram_bytes") if k in hw}
    out.update({f"model_{k}": model[k] for k in ("device", "dtype", "attention", "params", "trainable")
                if k in model})
    return out


def reasons(summary: dict) -> list[str]:
    """Why this plan, as far as the summary holds it: the planner's sentences (``plan_why``, written by
    ``train --auto``), the estimator's verdict at the card, its rule failures and the prediction's bases."""
    out = [str(x) for x in summary.get("plan_why") or [] if x]
    pred = summary.get("predicted") if isinstance(summary.get("predicted"), dict) else {}
    mem = pred.get("memory") if isinstance(pred.get("memory"), dict) else {}
    total = _number((mem.get("gpu_bytes") or {}).get("total")) if isinstance(mem.get("gpu_bytes"), dict) else None
    usable = _number(mem.get("usable_gpu_bytes"))
    if "fits" in pred and total is not None and usable is not None:
        verdict = "fits" if pred.get("fits") else "does not fit"
        margin = _number(mem.get("margin"))
        out.append(f"The estimator says this strategy {verdict}: {total / 1e9:.3g} GB per GPU of "
                   f"{usable / 1e9:.3g} GB usable" + (f" ({margin * 100:g} % kept free)." if margin else "."))
    out += [f"Rule: {r}" for r in pred.get("reasons") or []]
    as_ran = summary.get("predicted_step") if isinstance(summary.get("predicted_step"), dict) else {}
    time = pred.get("time") if isinstance(pred.get("time"), dict) else {}
    if time.get("basis"):
        out.append(f"Step time basis: {time['basis']}.")
    if as_ran.get("basis"):
        out.append(f"Step time as run: {as_ran['basis']}.")
    if as_ran.get("memory_basis"):
        out.append(f"Peak memory predicted {as_ran['memory_basis']}.")
    return out


def load_report(run_dir: Any, out: Any = None, summary: Optional[dict] = None) -> Report:
    """Read and check ``run_dir``; ``summary``: the run's summary dict when it is not written yet
    (``memfit train`` draws the report before it writes ``summary.json``)."""
    if summary is None:
        d = check_run_dir(run_dir)
        summary = read_summary(d / SUMMARY_FILE)
    else:
        d = Path(run_dir)
    metrics = d / METRICS_FILE
    rows = read_metrics(metrics) if summary is None or metrics.exists() else []  # a run that logged nothing
    pred = summary.get("predicted") if isinstance(summary.get("predicted"), dict) else {}
    strategy = pred.get("strategy") if isinstance(pred.get("strategy"), dict) else _run_file_strategy(d)
    method = summary.get("method") or strategy.get("method")
    return Report(
        run_dir=str(d), report_file=str(Path(out) if out is not None else d / REPORT_FILE),
        summary_file=str(d / SUMMARY_FILE), metrics_file=str(d / METRICS_FILE),
        method=str(method) if method else None, strategy=_label(strategy, str(method or "?")),
        levers={k: strategy[k] for k in LEVERS if k in strategy}, hardware=hardware(summary),
        steps=summary.get("steps") if isinstance(summary.get("steps"), int) else None,
        first_loss=_number(summary.get("first_loss")), final_loss=_number(summary.get("final_loss")),
        eval_loss=_number(summary.get("eval_loss")), series=series(rows), memory=memory_rows(summary),
        memory_measured_kind=summary.get("peak_mem_kind"), step_time=step_time(summary),
        reasons=reasons(summary), notes=[str(n) for n in summary.get("notes") or []],
    )


# ------------------------------------------------------------------ drawing
def write_report(run_dir: Any, out: Any = None, summary: Optional[dict] = None) -> Report:
    """Read ``run_dir``, draw the page and write it to ``out`` (default ``RUN_DIR/report.html``) whole or
    not at all. Everything is read and drawn before anything is written."""
    r = load_report(run_dir, out, summary)
    text = render_html(r)
    write_text(r.report_file, text, "report")
    return r


def report_after_training(out: Path, summary: dict) -> tuple[Optional[str], Optional[str]]:
    """``memfit train``'s report: (path written, None) or (None, a note saying why not and how to make
    it). Never raises: a failure here must not fail a finished training run."""
    how = f"`memfit report {out}`"
    if not plot_available():
        return None, f"no {REPORT_FILE}: matplotlib is not installed; {PLOT_INSTALL}, then {how}"
    try:
        return write_report(out, summary=summary).report_file, None
    except Exception as err:  # noqa: BLE001 -- one line, never a failed run
        msg = " ".join(str(err).split()) or type(err).__name__
        return None, f"{REPORT_FILE} not written ({msg[:200]}); try again with {how}"
