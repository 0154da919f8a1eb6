"""The recommendation in words (Markdown), from ``memfit plan --json``'s object: what ``memfit plan``
prints above its tables — strategy, step time and tokens/s with their basis and measured error, memory per
GPU against the card, CPU RAM, why, and what was ruled out. Strings read from a config are escaped."""

from __future__ import annotations

import html
from typing import Any, Optional

from memfit.steptime import STEP_PARTS


def _gb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def _rate(v: Optional[float]) -> str:
    return "-" if not v else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def esc(text: Any) -> str:
    """Text safe inside Markdown/HTML: no tags, no Markdown emphasis characters acting."""
    return html.escape(str(text)).replace("*", "&#42;").replace("_", "&#95;").replace("`", "&#96;")


def headline(d: dict) -> str:
    """'Recommended: lora+ddp+sdpa — 0.497 s/step, 2,059 tokens/s, 24.23 GB of 25.77 GB per GPU'."""
    rec = d.get("recommended")
    if rec is None:
        return "Nothing fits."
    from memfit.spec.strategy import Strategy

    label = Strategy(**rec["strategy"]).label()
    t, mem, hw = rec["time"], rec["memory"], rec["hardware"]
    return (f"Recommended: {label} — {t['step_seconds']:.3f} s/step, {_rate(t['tokens_per_second'])} tokens/s, "
            f"{_gb(mem['gpu_bytes']['total'])} of {_gb(hw['gpu_memory_bytes'])} per GPU")


def _time_lines(t: dict) -> list[str]:
    from memfit.steptime.accuracy import describe_time

    parts = [f"{t[k]:.3g} s {k.removesuffix('_seconds').replace('_', ' ')}"
             for k in STEP_PARTS if t.get(k)]
    lines = [f"**step time** {t['step_seconds']:.3f} s per optimizer step, {_rate(t.get('tokens_per_second'))} "
             f"tokens/s ({' + '.join(parts)})"]
    if t.get("basis"):
        lines.append(f"**time basis** {esc(t['basis'])}")
    lines.append(f"**time error** {esc(describe_time(t.get('published_error')))}")
    return lines


def _memory_lines(rec: dict) -> list[str]:
    from memfit.estimate.accuracy import describe

    mem, hw = rec["memory"], rec["hardware"]
    cpu = mem.get("cpu_bytes", {})
    phase = mem.get("cpu_peak_phase")
    return [
        f"**memory per GPU** {_gb(mem['gpu_bytes']['total'])} of {_gb(hw['gpu_memory_bytes'])} "
        f"(usable {_gb(mem.get('usable_gpu_bytes'))} with {mem.get('margin', 0):.0%} kept free); allocated "
        f"{_gb(mem.get('gpu_allocated_bytes'))}, reserved {_gb(mem.get('gpu_reserved_bytes'))}; "
        f"held against the card: {esc(mem.get('held_against_capacity', ''))}",
        f"**attention kernel** SDPA backend assumed: {esc(mem.get('attention_backend') or '-')}",
        f"**memory error** {esc(describe(mem.get('published_error')))}",
        f"**CPU RAM per node** {_gb(cpu.get('total'))}" + (f" (peak while {esc(phase)})" if phase else "")
        + f" of {_gb(hw.get('cpu_ram_bytes'))}",
    ]


def recommendation(d: dict, hardware_text: str, seconds: float, ruled_out: int = 0) -> str:
    """The whole text block: headline, model and pool, time, memory, why, what was rejected."""
    rec = d.get("recommended")
    out = [f"### {esc(headline(d))}"]
    if rec is not None:
        m = rec["model"]
        out.append(f"**model** {esc(m['name'])} ({m['parameters']:,} parameters, "
                   f"{m['trainable_parameters']:,} trainable) on **{esc(hardware_text)}**")
        out += _time_lines(rec["time"]) + _memory_lines(rec)
    out.append("**Why**")
    out += [f"- {esc(line)}" for line in d.get("why", [])]
    rejected = len(d.get("rejected", []))
    out.append(f"{len(d.get('candidates', []))} combinations fit; {rejected} rejected: {ruled_out} cannot run "
               f"here, {rejected - ruled_out} exceed memory (plan.json lists each with its reason). "
               f"Planned in {seconds:.2f} s.")
    return "\n\n".join(out)
