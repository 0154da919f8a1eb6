"""memfit's memory estimate held against published multi-GPU FSDP runs (gpu-runs/public-time.jsonl's peak_memory).

    PYTHONPATH=. .venv/bin/python bench/studies/gpu_published_fsdp.py          # the table, the summary, the skips
    PYTHONPATH=. .venv/bin/python bench/studies/gpu_published_fsdp.py --json   # machine-readable

public.jsonl (bench/gpu_published.py) holds no FSDP row; public-time.jsonl's multi-GPU runs from torchtune's README
(May 2024: FSDP1; Sept 2024: FSDP2), LitGPT's config hub (Fabric FSDP = FSDP1) and torchtitan (FSDP2) publish a
peak per GPU with their configuration. bench/studies/gpu_published_fsdp_rows.py maps each to a memfit run (the FSDP
version, metric class and units read from each project's source at the row's commit; its docstring cites them);
this file predicts each with ``memfit.estimate.estimate`` (what ``memfit.resolve.predict`` and the CLI call) at
margin 0 and compares like with like: allocated with the estimate's allocated peak, reserved with its reserved
peak. Signed error = (predicted - published) / published: negative is an under-prediction (the costly mistake).

Nothing here is fitted: every row is out of sample for the estimator's constants (fitted on public.jsonl only).
Rows whose selective activation checkpointing memfit cannot express (torchtitan's per-op AC) are shown as a
bracket (checkpointing on .. off) and scored only on whether the published figure lies inside it. Rows of low
reliability (settings the source does not publish) are predicted and listed, and summarised apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.studies.gpu_published_fsdp_rows import DEFAULT_FILE, FsdpCase, load

from memfit.estimate import estimate



def _peak(case: FsdpCase, strategy) -> dict:
    est = estimate(case.model, case.hardware, strategy, margin=0.0)
    mem = est.to_dict()["memory"]
    alloc, reserved = float(mem["gpu_allocated_bytes"]), float(mem["gpu_reserved_bytes"])
    return {"allocated": alloc, "reserved": reserved, "value": alloc if case.metric == "allocated" else reserved}


def predict(case: FsdpCase) -> dict:
    """One row: the prediction on the row's metric (a bracket: checkpointing on and off), the signed error."""
    s = case.strategy
    out = {"id": case.id, "group": case.group, "engine": case.engine, "source": case.source, "metric": case.metric,
           "metric_note": case.metric_note, "published": case.measured, "reliability": case.reliability,
           "kind": case.kind, "notes": list(case.notes), "strategy": s.label(),
           "gpus": f"{case.hardware.world_size}x{case.hardware.gpu.name}", "model": case.model.name,
           "mb": s.micro_batch_size, "ga": s.grad_accum, "seq": s.seq_len}
    p = _peak(case, s)
    out.update(predicted=p["value"], allocated=p["allocated"], reserved=p["reserved"])
    out["error"] = (p["value"] - case.measured) / case.measured
    if case.kind == "bracket":
        hi = _peak(case, s.model_copy(update={"gradient_checkpointing": False}))["value"]
        lo = _peak(case, s.model_copy(update={"gradient_checkpointing": True}))["value"]
        out.update(predicted=None, error=None, low=lo, high=hi, inside=lo <= case.measured <= hi)
    return out


def summarize(rows: list[dict]) -> dict:
    point = [r for r in rows if r["error"] is not None]
    absd = [abs(r["error"]) for r in point]
    return {"predicted": len(point), "median_abs": statistics.median(absd) if absd else None,
            "max_abs": max(absd) if absd else None,
            "median_signed": statistics.median(r["error"] for r in point) if point else None,
            "under_10": [r["id"] for r in point if r["error"] < -0.10],
            "over_10": [r["id"] for r in point if r["error"] > 0.10]}


def run(path: Path = DEFAULT_FILE) -> dict:
    """Every row predicted, the summaries (all point rows; those whose configuration is published, i.e. not of
    low reliability), the brackets and the skipped rows with their reasons."""
    cases, skipped = load(path)
    rows = [predict(c) for c in cases]
    brackets = [r for r in rows if r["kind"] == "bracket"]
    published = [r for r in rows if r["reliability"] != "low"]
    return {"file": Path(path).name, "rows": rows, "skipped": skipped,
            "summary": {"all": summarize(rows), "published_config": summarize(published),
                        "low_reliability": summarize([r for r in rows if r["reliability"] == "low"])},
            "brackets": {"rows": len(brackets), "inside": sum(1 for r in brackets if r["inside"])},
            "basis": "memfit.estimate.estimate at margin 0; nothing fitted on these rows (out of sample)"}


def _gb(x: float) -> str:
    return f"{x / 1e9:6.2f}"


def _pct(x) -> str:
    return "    -  " if x is None else f"{100 * x:+6.1f}%"


def _print_rows(rows: list[dict]) -> None:
    print(f"{'row':50s} {'engine':5s} {'metric':9s} {'GPUs':>16s} {'mb x ga':>7s} {'seq':>5s} "
          f"{'predicted':>9s} {'published':>9s} {'error':>7s}  (GB = 1e9 bytes)")
    for r in rows:
        pred = (f"{_gb(r['low']).strip()}..{_gb(r['high']).strip()}" if r["kind"] == "bracket"
                else _gb(r["predicted"]))
        err = ("inside" if r["inside"] else "OUTSIDE") if r["kind"] == "bracket" else _pct(r["error"])
        print(f"{r['id'][:50]:50s} {r['engine'][:5]:5s} {r['metric']:9s} {r['gpus'][:16]:>16s} "
              f"{r['mb']:>3d} x {r['ga']:<2d} {r['seq']:5d} {pred:>9s} {_gb(r['published']):>9s} {err:>7s}"
              + ("  [low reliability]" if r["reliability"] == "low" else ""))


def _print_summary(name: str, s: dict) -> None:
    if not s["predicted"]:
        return
    print(f"  {name:34s} {s['predicted']:2d} rows: median |error| {100 * s['median_abs']:.1f} %, max "
          f"{100 * s['max_abs']:.1f} %, signed median {100 * s['median_signed']:+.1f} %; more than 10 % under: "
          f"{len(s['under_10'])}" + (f" ({', '.join(s['under_10'])})" if s["under_10"] else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE, help="published runs (public-time.jsonl)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if not args.file.is_file():
        print(f"error: --file {args.file}: no such file; point it at gpu-runs/public-time.jsonl", file=sys.stderr)
        return 2
    out = run(args.file)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"multi-GPU FSDP rows of {out['file']} with a published peak; {out['basis']}")
    _print_rows(out["rows"])
    print("\nper row: engine as read from the source, metric basis, source, uncertain fields")
    for r in out["rows"]:
        print(f"  {r['id']}: {r['engine']}; {r['metric']}: {r['metric_note']}; {r['strategy']}\n"
              f"    source {r['source']}" + (f"\n    uncertain: {'; '.join(r['notes'])}" if r["notes"] else ""))
    print("\nsummary (signed error = predicted / published - 1):")
    _print_summary("all predicted rows", out["summary"]["all"])
    _print_summary("configuration published", out["summary"]["published_config"])
    _print_summary("low reliability (settings unpublished)", out["summary"]["low_reliability"])
    b = out["brackets"]
    print(f"  selective-AC brackets (checkpointing on..off): {b['inside']} of {b['rows']} published figures inside")
    print(f"\nskipped {len(out['skipped'])} rows:")
    for s in out["skipped"]:
        print(f"  {s['id']}: {s['why']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
