"""Rich tables for ``estimate``, ``plan`` and ``matrix``. Sizes are decimal GB (10⁹ bytes)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from rich import box
from rich.markup import escape
from rich.table import Table

from memfit.cli.output import console, err_console, print_json  # noqa: F401  (print_json re-exported)
from memfit.spec.strategy import LONG_CONTEXT_LEVERS
from memfit.steptime import STEP_PARTS

def _gb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


COMPACT = dict(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1), collapse_padding=True)
KIND_TEXT = {"formula": "formula", "engine": "engine config", "overhead": "overhead (fixed/hidden)"}


def memory_table(d: dict, title: str = "Memory per GPU and CPU RAM per node (decimal GB)",
                 unit: str = "GPU") -> Table:
    """Per-GPU breakdown, each line marked formula / engine / overhead, then the CPU RAM lines."""
    mem = d.get("memory", {})
    kinds = mem.get("gpu_line_kinds") or {}
    t = Table(title=title, title_justify="left")
    t.add_column("component")
    t.add_column("GB", justify="right")
    t.add_column("kind", style="dim")
    gpu = mem.get("gpu_bytes", {})
    for name, value in gpu.items():
        if name == "total" or not value:
            continue
        t.add_row(name, _gb(value), KIND_TEXT.get(kinds.get(name, ""), kinds.get(name, "")))
        if name == "overhead":
            for sub, v in (mem.get("gpu_overhead_bytes") or {}).items():
                if v:
                    t.add_row(f"  {sub}", f"[dim]{_gb(v)}[/dim]", "")
    t.add_row(f"[bold]total per {unit}[/bold]", f"[bold]{_gb(gpu.get('total'))}[/bold]",
              f"of {_gb(d.get('hardware', {}).get('gpu_memory_bytes'))}, usable "
              f"{_gb(mem.get('usable_gpu_bytes'))}" if mem.get("usable_gpu_bytes") else "")
    if unit == "GPU" and "gpu_reserved_bytes" in mem:
        _cuda_rows(t, mem)
    cpu = mem.get("cpu_bytes", {})
    if cpu:
        t.add_section()
        for name, value in cpu.items():
            if name != "total" and value:
                t.add_row(f"CPU {name}", _gb(value), "per node")
        phase = mem.get("cpu_peak_phase")
        t.add_row("[bold]CPU RAM per node[/bold]", f"[bold]{_gb(cpu.get('total'))}[/bold]",
                  (f"peak while {phase}; " if phase else "")
                  + f"node has {_gb(d.get('hardware', {}).get('cpu_ram_bytes'))}")
    if unit == "GPU" and len(mem.get("run_phases") or {}) > 2:
        _phase_rows(t, mem)
    return t


PHASE_TEXT = {"load": "loading", "train_step": "training step", "eval": "evaluation", "save": "checkpoint save"}


def _phase_rows(t: Table, mem: dict) -> None:
    """Run phases (memfit.estimate.phases): each one's per-GPU figure held against the card and the node's CPU
    RAM; which sets each peak (the verdict holds the largest)."""
    from memfit.estimate.phases import ORDER

    phases, settings = mem["run_phases"], mem.get("phase_settings") or {}
    ev, save = settings.get("eval") or {}, (settings.get("save") or {}).get("mode")
    t.add_section()
    t.add_row("[bold]run phases[/bold]", "GPU GB", "CPU GB per node; the verdict holds the largest")
    cpu_peak = max((k for k in ORDER if k in phases), key=lambda k: phases[k]["cpu_bytes"])  # ties: the step
    for name, fig in phases.items():
        marks = [m for m, hit in (("sets the GPU peak", name == mem.get("gpu_peak_phase")),
                                  ("sets the CPU peak", name == cpu_peak)) if hit]
        kept = "loss only" if ev.get("loss_only", True) else "logits kept"
        what = {"eval": f" (b {ev.get('batch_size')}, {kept})", "save": f" ({save})" if save else ""}.get(name, "")
        t.add_row(f"  {PHASE_TEXT.get(name, name)}{what}", _gb(fig["gpu_bytes"]),
                  f"{_gb(fig['cpu_bytes'])}" + (f"  [bold]{', '.join(marks)}[/bold]" if marks else ""))


def _cuda_rows(t: Table, mem: dict) -> None:
    """What the CUDA allocator reports, which figure is held against the card, the attention kernel assumed
    and the estimator's measured error on published runs of this kind."""
    from memfit.estimate.accuracy import describe

    t.add_row("  allocated (tensors)", _gb(mem.get("gpu_allocated_bytes")), "torch max_memory_allocated")
    t.add_row("  reserved (caching allocator)", _gb(mem.get("gpu_reserved_bytes")), "torch max_memory_reserved")
    total = mem.get("gpu_bytes", {}).get("total")
    needed = (mem.get("run_phases") or {}).get("train_step", {}).get("gpu_bytes", mem.get("gpu_needed_bytes"))
    t.add_row("  nvidia-smi", _gb(total), "reserved + CUDA context + NCCL")
    if needed is not None and total is not None and needed < total:  # whole free segments, freed on demand
        t.add_row("  held against the card", _gb(needed), "less the free segments the allocator releases when the "
                  "card is full")
    else:
        t.add_row("  held against the card", _gb(total), "all of it (the step's verdict figure)")
    if mem.get("gpu_loading_bytes"):
        t.add_row("  while loading", _gb(mem["gpu_loading_bytes"]), "tensors while quantising to NF4 on the GPU")
    t.add_row("  attention kernel", "", f"SDPA backend assumed: {mem.get('attention_backend') or '-'}")
    t.add_row("  published runs", "", describe(mem.get("published_error")))


def _memory_table(d: dict, hardware: Any) -> Table:
    if hardware.gpu.is_cpu:  # the CPU device: every process's lines and the process lines share one RAM
        return memory_table(d, "Memory per process and per node, all in the node's RAM (decimal GB)", "process")
    return memory_table(d)


def summary_table(d: dict, hardware: Any) -> Table:
    """Model, pool, the combination, step time, tokens/s and the floors."""
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    m, s, time = d.get("model", {}), d.get("strategy", {}), d.get("time", {})
    t.add_row("model", f"{m.get('name')}  ({m.get('parameters', 0):,} parameters, "
                       f"{m.get('trainable_parameters', 0):,} trainable)")
    hw = d.get("hardware", {})
    if hardware.gpu.is_cpu:
        t.add_row("hardware", f"{hardware.text()}: the CPU as the training device "
                              f"({_gb(hw.get('cpu_ram_bytes'))} GB RAM)")
    else:
        t.add_row("hardware", f"{hardware.text()}  ({_gb(hw.get('gpu_memory_bytes'))} GB per GPU, "
                              f"{_gb(hw.get('cpu_ram_bytes'))} GB CPU RAM per node)")
    keys = ["method", "zero_stage", "fsdp", "offload", "gradient_checkpointing", "attention", "optimizer",
            "precision", "micro_batch_size", "grad_accum", "seq_len", "loss"]
    if not hardware.gpu.is_cpu:
        keys.append("allocator")
    if s.get("method") in ("lora", "qlora"):
        keys += ["lora_r", "lora_targets"]
    if s.get("method") == "qlora":
        keys += ["quant_storage"]
    if s.get("method") == "meft":
        keys += ["meft_neurons", "meft_top_k"]
    keys += [k for k, off in LONG_CONTEXT_LEVERS if s.get(k, off) != off]  # the long-context levers in use
    t.add_row("strategy", "  ".join(f"{k}={_show(s.get(k))}" for k in keys if k in s))
    if "step_seconds" in time:
        parts = [f"{time[k]:.3g} s {k.removesuffix('_seconds').replace('_', ' ')}"
                 for k in STEP_PARTS if time.get(k)]
        t.add_row("step time", f"{time['step_seconds']:.3f} s per optimizer step, "
                               f"{_rate(time.get('tokens_per_second', 0))} tokens/s  ({' + '.join(parts)})")
        if time.get("basis"):
            t.add_row("time basis", time["basis"])
        if time.get("published_error"):
            from memfit.steptime.accuracy import describe_time
            t.add_row("time error", describe_time(time["published_error"]))
    if d.get("long_context_error"):
        from memfit.estimate.accuracy import describe_long_context
        t.add_row("long context", describe_long_context(d["long_context_error"]))
    floors = d.get("floors") or {}
    if floors:
        t.add_row("floors", f"memory {_gb(floors.get('memory_bytes'))} GB per GPU (frozen weights at their "
                            f"precision, no combination goes under); time {floors.get('step_seconds', 0):.3g} s "
                            "per step (FLOPs / peak FLOP/s)")
    return t


def _rate(v: Optional[float]) -> str:
    if not v:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _show(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return str(v)


def show_estimate(result: Any, hardware: Any, notes: list = ()) -> None:
    d = result.to_dict()
    console.print(summary_table(d, hardware))
    console.print(_memory_table(d, hardware))
    verdict = "[green]fits[/green]" if d["fits"] else "[red]does not fit[/red]"
    console.print(f"{verdict} (keeping {result.margin:.0%} free)")
    for r in d.get("reasons", []):
        console.print(f"  - {r}")
    for n in notes:  # e.g. memfit.spec.context's note: RoPE past its trained length
        console.print(f"[yellow]note:[/yellow] {escape(n)}")


def candidates_table(candidates: list, top: int, hardware: Any) -> Table:
    t = Table(title=f"Fastest combinations that fit (top {min(top, len(candidates))} of {len(candidates)})",
              title_justify="left", **COMPACT)
    for col, just in (("#", "right"), ("combination", "left"), ("s/step", "right"), ("tokens/s", "right"),
                      ("GB/GPU", "right"), ("CPU GB", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for i, c in enumerate(candidates[:top], 1):
        tps = c.to_dict().get("time", {}).get("tokens_per_second")
        t.add_row(str(i), c.strategy.label(), f"{c.step_seconds:.3g}", _rate(tps),
                  _gb(c.gpu_total), _gb(c.cpu_total))
    return t


def show_plan(p: Any, *, top: int = 8, emitted: list = (), run: Optional[dict] = None) -> None:
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
        console.print(_memory_table(rec.to_dict(), p.hardware))
        console.print(candidates_table(p.candidates, top, p.hardware))
        basis = d.get("time", {}).get("basis")
        if basis:
            console.print(f"[dim]step times: {basis}[/dim]")
    if run:
        cost = f", {run['cost']:.2f} at the given GPU-hour price" if run.get("cost") is not None else ""
        console.print(f"[bold]Run:[/bold] {run['steps']:,} steps of {run['tokens_per_step']:,} tokens = "
                      f"{run['hours']:.2f} hours{cost}")
    n_rule = sum(1 for r in p.rejected if r.kind == "rule")
    console.print(f"[dim]{len(p.rejected)} combinations rejected: {n_rule} cannot run here, "
                  f"{len(p.rejected) - n_rule} exceed memory (--json lists each with its reason).[/dim]")
    for path in emitted:
        console.print(f"wrote {path}")


def show_gpu_count(result: Any, emitted: list = ()) -> None:
    t = Table(title=f"GPU count search: {result.gpu} (decimal GB)", title_justify="left", **COMPACT)
    from memfit.plan.matrix import short_label

    for col in ("GPUs", "fastest that fits", "s/step", "tok/s", "GB/GPU", "CPU GB", "steps", "hours", "cost"):
        t.add_column(col, justify="left" if col == "fastest that fits" else "right", no_wrap=True)
    best = result.best
    for r in result.rows:
        rec = r.recommended
        if rec is None:
            t.add_row(str(r.gpus), "[red]nothing fits[/red]", *["-"] * 7)
            continue
        tps = rec.to_dict().get("time", {}).get("tokens_per_second")
        mark = "[green]▶[/green] " if best is r else ""
        t.add_row(mark + str(r.gpus), short_label(rec.strategy), f"{rec.step_seconds:.3g}",
                  _rate(tps), f"{rec.gpu_total / 1e9:.1f}", f"{rec.cpu_total / 1e9:.1f}",
                  f"{r.steps}" if r.steps is not None else "-",
                  f"{r.hours:.1f}" if r.hours is not None else "-",
                  f"{r.cost:.2f}" if r.cost is not None else "-")
    console.print(t)
    if best is not None:
        how = ("lowest cost" if best.cost is not None else "shortest run" if best.hours is not None
               else "most tokens per second; give --tokens or --steps (and --gpu-hour-price) for time and cost")
        console.print(f"▶ best: {best.gpus} GPU(s), {best.recommended.strategy.label()} ({how}). "
                      "CPU GB = CPU RAM per node; GB/GPU = peak per GPU.")
    for path in emitted:
        console.print(f"wrote {path}")


def show_matrix(m: Any, png: Any = None) -> None:
    rows = m.rows()
    methods = {c.split("+")[0] for row in rows for c in row if c != "✗"}
    common = methods.pop() if len(methods) == 1 else None
    if common:  # every cell uses the same method: say it once, keep the cells narrow
        rows = [[c.removeprefix(common + "+") for c in row] for row in rows]
    t = Table(title=f"Fastest recipe that fits on {m.hardware.text()}"
                    + (f" — {common} in every cell" if common else ""), title_justify="left", **COMPACT)
    t.add_column("model \\ seq_len", no_wrap=True)
    for s in m.seq_lens:
        t.add_column(str(s), no_wrap=True)
    for model, row in zip(m.models, rows):
        t.add_row(model, *[f"[red]{c}[/red]" if c == "✗" else c for c in row])
    console.print(t)
    console.print("[dim]✗ = nothing fits; ×2n = needs two nodes; Z1/Z2/Z3 = DeepSpeed ZeRO stage; GC = gradient "
                  "checkpointing; Off = optimizer offload to CPU, OffP = + parameters; CCE = chunked cross-entropy "
                  "(--loss chunked); attention is SDPA unless FA2/eager is shown. Long-context levers, tried only "
                  "where nothing fits without them (so a cell naming one lies beyond the frontier without them): "
                  "SPn = Ulysses over n GPUs, CPn = context parallelism, AO = activation offload, TM = tiled MLP."
                  "[/dim]")
    if png is not None:
        console.print(f"wrote {png}")


@contextlib.contextmanager
def progress(what: str, quiet: bool = False) -> Iterator[None]:
    if quiet:
        yield
        return
    with err_console.status(what + " ..."):
        yield
