"""Rich tables for ``estimate``, ``plan`` and ``matrix``. Sizes are decimal GB (10⁹ bytes)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from rich.table import Table

from memfit.cli.output import console, err_console, print_json  # noqa: F401  (print_json re-exported)
from memfit.plan import facts

# Lines of the per-GPU breakdown that come from formulas; everything else is a fixed/hidden overhead.
FORMULA_PARTS = {"weights", "gradients", "optimizer", "activations", "logits", "lora", "adapter",
                 "quant_constants", "gathered", "meft_buffers"}


def _gb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, float]]:
    out = []
    for key, value in d.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((prefix + key, float(value)))
    return out


def _kind(name: str, notes: dict) -> str:
    if name in notes:
        return str(notes[name])
    base = name.split(".")[0]
    if base in FORMULA_PARTS:
        return "formula"
    return "overhead" if any(w in name for w in ("overhead", "context", "allocator", "fragment", "nccl",
                                                    "buffer", "bucket", "cuda", "workspace")) else "formula"


def memory_table(d: dict, title: str = "Memory per GPU (decimal GB)") -> Table:
    """Per-GPU breakdown, each line marked formula or overhead, then the CPU RAM lines."""
    mem = d.get("memory", {})
    notes = mem.get("kinds", {}) if isinstance(mem.get("kinds"), dict) else {}
    t = Table(title=title, title_justify="left")
    t.add_column("component")
    t.add_column("GB", justify="right")
    t.add_column("kind", style="dim")
    gpu = mem.get("gpu_bytes", {})
    for name, value in _flatten({k: v for k, v in gpu.items() if k != "total"}):
        t.add_row(name, _gb(value), _kind(name, notes))
    t.add_row("[bold]total per GPU[/bold]", f"[bold]{_gb(gpu.get('total'))}[/bold]", "")
    cpu = mem.get("cpu_bytes", {})
    if cpu:
        t.add_section()
        for name, value in _flatten({k: v for k, v in cpu.items() if k != "total"}):
            t.add_row(f"CPU {name}", _gb(value), "per node")
        t.add_row("[bold]CPU RAM per node[/bold]", f"[bold]{_gb(cpu.get('total'))}[/bold]", "")
    return t


def summary_table(d: dict, hardware: Any) -> Table:
    """Model, pool, the combination, step time, tokens/s and the floors."""
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    m, s, time = d.get("model", {}), d.get("strategy", {}), d.get("time", {})
    t.add_row("model", f"{m.get('name')}  ({m.get('parameters', 0):,} parameters, "
                       f"{m.get('trainable_parameters', 0):,} trainable)")
    hw = d.get("hardware", {})
    t.add_row("hardware", f"{facts.hardware_text(hardware)}  ({_gb(hw.get('gpu_memory_bytes'))} GB per GPU, "
                          f"{_gb(hw.get('cpu_ram_bytes'))} GB CPU RAM per node)")
    keys = ["method", "zero_stage", "fsdp", "offload", "gradient_checkpointing", "attention", "optimizer",
            "precision", "micro_batch_size", "grad_accum", "seq_len"]
    if s.get("method") in ("lora", "qlora"):
        keys += ["lora_r", "lora_targets"]
    if s.get("method") == "qlora":
        keys += ["quant_storage"]
    if s.get("method") == "meft":
        keys += ["meft_neurons", "meft_top_k"]
    t.add_row("strategy", "  ".join(f"{k}={_show(s.get(k))}" for k in keys if k in s))
    if "step_seconds" in time:
        t.add_row("step time", f"{time['step_seconds']:.3f} s   ({time.get('tokens_per_second', 0):,.0f} tokens/s)")
    floors = d.get("floors") or {}
    if floors:
        t.add_row("floors", "  ".join(
            f"{k}={_gb(v)} GB" if "bytes" in k else f"{k}={v:.3g}" if isinstance(v, (int, float)) else f"{k}={v}"
            for k, v in floors.items()))
    return t


def _show(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return str(v)


def show_estimate(result: Any, hardware: Any) -> None:
    d = result.to_dict()
    console.print(summary_table(d, hardware))
    console.print(memory_table(d))
    verdict = "[green]fits[/green]" if d["fits"] else "[red]does not fit[/red]"
    console.print(f"{verdict} (keeping {result.margin:.0%} free)")
    for r in d.get("reasons", []):
        console.print(f"  - {r}")


def candidates_table(candidates: list, top: int, hardware: Any) -> Table:
    t = Table(title=f"Fastest combinations that fit (top {min(top, len(candidates))} of {len(candidates)})",
              title_justify="left")
    for col, just in (("#", "right"), ("combination", "left"), ("s/step", "right"), ("tokens/s", "right"),
                      ("GB/GPU", "right"), ("CPU GB", "right")):
        t.add_column(col, justify=just)
    for i, c in enumerate(candidates[:top], 1):
        tps = c.to_dict().get("time", {}).get("tokens_per_second")
        t.add_row(str(i), c.strategy.label(), f"{c.step_seconds:.3f}", f"{tps:,.0f}" if tps else "-",
                  _gb(c.gpu_total), _gb(c.cpu_total))
    return t


def show_plan(p: Any, *, top: int = 8, emitted: list = ()) -> None:
    rec = p.recommended
    if rec is not None:
        d = rec.to_dict()
        console.print(f"[bold green]Recommended:[/bold green] {rec.strategy.label()}")
        console.print(summary_table(d, p.hardware))
    else:
        console.print("[bold red]Nothing fits.[/bold red]")
    console.print("[bold]Why[/bold]")
    for line in p.why:
        console.print(f"  - {line}")
    if rec is not None:
        console.print(memory_table(rec.to_dict()))
        console.print(candidates_table(p.candidates, top, p.hardware))
    n_rule = sum(1 for r in p.rejected if r.kind == "rule")
    console.print(f"[dim]{len(p.rejected)} combinations rejected: {n_rule} cannot run here, "
                  f"{len(p.rejected) - n_rule} exceed memory (--json lists each with its reason).[/dim]")
    for path in emitted:
        console.print(f"wrote {path}")


def show_gpu_count(result: Any, emitted: list = ()) -> None:
    t = Table(title=f"GPU count search: {result.gpu} (decimal GB)", title_justify="left")
    for col in ("GPUs", "best combination", "s/step", "tokens/s", "GB/GPU", "CPU RAM GB", "steps", "hours",
                "cost"):
        t.add_column(col, justify="left" if col == "best combination" else "right")
    best = result.best
    for r in result.rows:
        rec = r.recommended
        if rec is None:
            t.add_row(str(r.gpus), "[red]nothing fits[/red]", *["-"] * 7)
            continue
        tps = rec.to_dict().get("time", {}).get("tokens_per_second")
        mark = " [green]◀ best[/green]" if best is r else ""
        t.add_row(str(r.gpus), rec.strategy.label() + mark, f"{rec.step_seconds:.3f}",
                  f"{tps:,.0f}" if tps else "-", _gb(rec.gpu_total), _gb(rec.cpu_total),
                  f"{r.steps:,}" if r.steps is not None else "-",
                  f"{r.hours:.2f}" if r.hours is not None else "-",
                  f"{r.cost:.2f}" if r.cost is not None else "-")
    console.print(t)
    if best is not None and best.cost is None and best.hours is None:
        console.print("[dim]best = most tokens per second per step; give --tokens or --steps (and "
                      "--gpu-hour-price) for total time and cost.[/dim]")
    for path in emitted:
        console.print(f"wrote {path}")


def show_matrix(m: Any, png: Any = None) -> None:
    t = Table(title=f"Fastest recipe that fits on {facts.hardware_text(m.hardware)} "
                    "(✗ = nothing fits; ×2n = on two nodes)", title_justify="left")
    t.add_column("model \\ seq_len")
    for s in m.seq_lens:
        t.add_column(str(s))
    for model, row in zip(m.models, m.rows()):
        t.add_row(model, *[f"[red]{c}[/red]" if c == "✗" else c for c in row])
    console.print(t)
    console.print("[dim]Z1/Z2/Z3 = DeepSpeed ZeRO stage, GC = gradient checkpointing, Off = optimizer "
                  "offload to CPU, OffP = + parameter offload; SDPA attention unless FA2/eager shown.[/dim]")
    if png is not None:
        console.print(f"wrote {png}")


@contextlib.contextmanager
def progress(what: str, quiet: bool = False) -> Iterator[None]:
    if quiet:
        yield
        return
    with err_console.status(what + " ..."):
        yield
