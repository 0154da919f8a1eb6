"""The run report's page: its figures (inline SVG drawn with matplotlib, imported only here) and its HTML, every
string from the run folder escaped. ``r`` is memfit.train.report's ``Report`` (``load_report``)."""

from __future__ import annotations

import html
import io
from typing import Any, Optional

def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "—"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10000:
        return f"{v:,}"
    return str(v)


def _svg(fig, name: str) -> str:
    """The figure as an inline <svg> element: text kept as text, no XML prolog, DOCTYPE, metadata or
    namespace URLs (an HTML page's inline SVG needs none)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight",
                metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    for attr in (' xmlns:xlink="http://www.w3.org/1999/xlink"', ' xmlns="http://www.w3.org/2000/svg"'):
        text = text.replace(attr, "", 1)
    return text.replace("<svg", f'<svg role="img" aria-label="{html.escape(name)}"', 1)


def figures(r: Any) -> dict[str, str]:
    """name -> inline SVG of each chart the data allows."""
    import matplotlib
    from matplotlib.figure import Figure

    out: dict[str, str] = {}
    s = r.series
    base = {"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False}

    def new(name: str, size=(6.4, 2.8)):
        fig = Figure(figsize=size)
        return fig, fig.add_subplot()

    with matplotlib.rc_context(base):
        if "loss" in s or "eval_loss" in s:
            with matplotlib.rc_context({"svg.hashsalt": "memfit-loss"}):
                fig, ax = new("loss")
                if "loss" in s:
                    ax.plot(*zip(*s["loss"]), label="train loss", color="#1f77b4", linewidth=1.4)
                if "eval_loss" in s:
                    ax.plot(*zip(*s["eval_loss"]), "o--", label="eval loss", color="#d62728", markersize=5)
                ax.set_xlabel("step")
                ax.set_ylabel("loss")
                ax.legend(frameon=False)
                out["loss"] = _svg(fig, "loss and eval loss by step")
        if "learning_rate" in s:
            with matplotlib.rc_context({"svg.hashsalt": "memfit-lr"}):
                fig, ax = new("lr", (6.4, 2.2))
                ax.plot(*zip(*s["learning_rate"]), color="#2ca02c", linewidth=1.4)
                ax.set_xlabel("step")
                ax.set_ylabel("learning rate")
                out["learning_rate"] = _svg(fig, "learning rate by step")
        if "step_time_s" in s or "tokens_per_s" in s:
            with matplotlib.rc_context({"svg.hashsalt": "memfit-time"}):
                fig = Figure(figsize=(6.4, 4.4))
                ax1, ax2 = fig.subplots(2, 1, sharex=True)
                if "step_time_s" in s:
                    steps, secs = zip(*s["step_time_s"])
                    ax1.plot(steps, [x * 1000 for x in secs], color="#9467bd", linewidth=1.2, label="measured")
                t = r.step_time
                if "predicted_step_s" in t:
                    ax1.axhline(t["predicted_step_s"] * 1000, color="#ff7f0e", linestyle="--",
                                label="predicted, as run")
                if "planned_step_s" in t:
                    ax1.axhline(t["planned_step_s"] * 1000, color="#7f7f7f", linestyle=":",
                                label="predicted, as planned")
                ax1.set_ylabel("step time (ms)")
                ax1.legend(frameon=False, fontsize=8)
                if "tokens_per_s" in s:
                    ax2.plot(*zip(*s["tokens_per_s"]), color="#8c564b", linewidth=1.2)
                ax2.set_xlabel("step")
                ax2.set_ylabel("tokens/s")
                out["step_time"] = _svg(fig, "step time and tokens per second by step")
        rows = [m for m in r.memory if m["predicted_bytes"] is not None or m["measured_bytes"] is not None]
        if rows:
            with matplotlib.rc_context({"svg.hashsalt": "memfit-memory"}):
                fig, ax = new("memory", (6.4, 0.32 * len(rows) + 1.2))
                ys = range(len(rows))
                h = 0.4
                pred = [(m["predicted_bytes"] or 0) / 1e6 for m in rows]
                meas = [(m["measured_bytes"] or 0) / 1e6 for m in rows]
                ax.barh([y - h / 2 for y in ys], pred, h, label="predicted", color="#1f77b4")
                ax.barh([y + h / 2 for y in ys], meas, h, label="measured", color="#ff7f0e")
                ax.set_yticks(list(ys), [m["component"] for m in rows])
                ax.invert_yaxis()
                ax.set_xlabel("MB")
                ax.legend(frameon=False, fontsize=8)
                out["memory"] = _svg(fig, "predicted and measured memory by component")
    return out


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;
color:#222;line-height:1.4}
h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5rem 0;font-size:.9rem}
td,th{border:1px solid #ddd;padding:.2rem .5rem;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
th{background:#f4f4f4}figure{margin:.5rem 0}svg{max-width:100%;height:auto}.dim{color:#666}
"""


def _table(head: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    e = html.escape
    parts = ["<table><thead><tr>", *(f"<th>{e(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for row in rows:
        parts.append("<tr>" + "".join(f'<td class="n">{e(_fmt(c))}</td>' if i in numeric else
                                      f"<td>{e(_fmt(c))}</td>" for i, c in enumerate(row)) + "</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def render_html(r: Any, figs: Optional[dict[str, str]] = None) -> str:
    """The page: every string from the run folder escaped, figures inline, nothing fetched."""
    e = html.escape
    figs = figures(r) if figs is None else figs
    title = f"memfit run report: {r.strategy}"
    p = [f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
         f'<meta name="viewport" content="width=device-width, initial-scale=1">'
         f"<title>{e(title)}</title><style>{CSS}</style></head><body>",
         f"<h1>{e(title)}</h1>", f'<p class="dim">run folder {e(r.run_dir)}</p>']
    # summary
    rows = [["strategy", r.strategy], ["steps", r.steps if r.steps is not None else "—"]]
    if r.first_loss is not None and r.final_loss is not None:
        rows.append(["train loss (first → last)", f"{r.first_loss:.4f} → {r.final_loss:.4f}"])
    if r.eval_loss is not None:
        rows.append(["eval loss", f"{r.eval_loss:.4f}"])
    p += ["<h2>Summary</h2>", _table(["", ""], rows)]
    # curves
    p.append("<h2>Loss</h2>")
    p.append(f"<figure>{figs['loss']}</figure>" if "loss" in figs else '<p class="dim">no loss logged</p>')
    if "learning_rate" in figs:
        p += ["<h2>Learning rate</h2>", f"<figure>{figs['learning_rate']}</figure>"]
    # time
    p.append("<h2>Step time and tokens/s</h2>")
    if "step_time" in figs:
        p.append(f"<figure>{figs['step_time']}</figure>")
    t = r.step_time
    trows = []
    def ms(v):
        return f"{v * 1000:.1f} ms"
    meas = t.get("measured_step_s")
    for key, label in (("predicted_step_s", "predicted as run"),
                       ("planned_step_s", f"predicted as planned ({t.get('planned_shape', '')})".replace(" ()", ""))):
        if key in t:
            err = f"{(t[key] - meas) / meas * 100:+.0f} %" if meas else ""
            trows.append([label, ms(meas) if meas else "—", ms(t[key]), err])
    if not trows and meas:
        trows.append(["step time (median)", ms(meas), "—", ""])
    if "measured_tokens_per_s" in t or "planned_tokens_per_s" in t:
        mt, pt = t.get("measured_tokens_per_s"), t.get("planned_tokens_per_s")
        trows.append(["tokens/s (planned shape)", f"{mt:,.0f}" if mt else "—", f"{pt:,.0f}" if pt else "—",
                      f"{(pt - mt) / mt * 100:+.0f} %" if mt and pt else ""])
    if trows:
        p.append(_table(["step time", "measured (median)", "predicted", "pred. vs meas."], trows, {1, 2, 3}))
    for key, label in (("predicted_basis", "as run"), ("time_basis", "basis")):
        if t.get(key):
            p.append(f'<p class="dim">{e(label)}: {e(str(t[key]))}</p>')
    # memory
    p.append("<h2>Memory: predicted vs measured</h2>")
    if "memory" in figs:
        p.append(f"<figure>{figs['memory']}</figure>")
    if r.memory:
        p.append(_table(["component", "predicted", "measured", "pred. vs meas.", "what"],
                        [[m["component"], _bytes(m["predicted_bytes"]), _bytes(m["measured_bytes"]),
                          f"{m['error_pct']:+.1f} %" if m["error_pct"] is not None else "", m["kind"]]
                         for m in r.memory], {1, 2, 3}))
        p.append('<p class="dim">A training run measures one peak, not each component: on a GPU the CUDA '
                 "allocator's peak (against the predicted tensors), on CPU the process's peak RSS. "
                 "<code>memfit measure RUN.yaml</code> measures the components.</p>")
    else:
        p.append('<p class="dim">the summary holds no memory figures</p>')
    # strategy and hardware
    p.append("<h2>Strategy and hardware</h2>")
    if r.levers:
        p.append(_table(["lever", "value"], [[k, v] for k, v in r.levers.items()]))
    if r.hardware:
        hw = [[k, _bytes(v) if k.endswith("_bytes") and isinstance(v, (int, float)) else v]
              for k, v in r.hardware.items()]
        p.append(_table(["hardware", "value"], hw))
    # reasons and notes
    p.append("<h2>Why this plan</h2>")
    if r.reasons:
        p.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in r.reasons) + "</ul>")
    else:
        p.append('<p class="dim">the summary holds no reasons for this run</p>')
    if r.notes:
        p += ["<h2>Notes</h2>", "<ul>" + "".join(f"<li>{e(x)}</li>" for x in r.notes) + "</ul>"]
    # the numbers behind the curves
    names = [n for n in ("loss", "eval_loss", "learning_rate", "step_time_s", "tokens_per_s", "grad_norm")
             if n in r.series]
    if names:
        by_step: dict[int, dict] = {}
        for n in names:
            for step, v in r.series[n]:
                by_step.setdefault(int(step), {})[n] = v
        p.append("<h2>Metrics by step</h2><details><summary>from metrics.jsonl</summary>")
        p.append(_table(["step", *names], [[s, *(by_step[s].get(n, "") for n in names)]
                                           for s in sorted(by_step)], set(range(len(names) + 1))))
        p.append("</details>")
    p.append(f'<p class="dim">{e(r.summary_file)} · {e(r.metrics_file)}</p></body></html>\n')
    return "".join(p)
