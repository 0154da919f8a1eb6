"""memfit's uncalibrated catalog time model held against published GPU throughputs.

    PYTHONPATH=. .venv/bin/python bench/gpu_time_published.py            # tables per group
    PYTHONPATH=. .venv/bin/python bench/gpu_time_published.py --json     # machine-readable

Ground truth (no fitting to any of it):

* ``fms-main`` (high reliability): IBM fms-acceleration's reference CSV, one A100-80GB, plain HF stack,
  packed 4096-token blocks (santacoder: 2048, its position limit; the CSV's samples/s x 2048 = its
  tokens/s), checkpointing, FlashAttention-2, 100 steps; ``train_tokens_per_second`` = samples/s ×
  block length (the HF Trainer's figure over the whole ``train()``, warm-up step included). Each row
  becomes memfit's (model, hardware, strategy) through bench/gpu_published.py's ``convert`` (the same
  mapping its memory check uses).
* ``gpu-check-h200``: memfit's own trainer on an H200 (bench/results/gpu_check_h200_2026-11-30*.json,
  one timed step each after a warm-up and a profiled step; docs/gpu-check.md), mapped by
  bench/gpu_published.py's ``load_gpu_check``.
* ``deepspeed`` (low reliability, reported apart): DeepSpeed issue 3901, Falcon-7B at 4k on 8× A100-40GB,
  step seconds per engine; micro-batch, precision, checkpointing and attention were not published, so
  each row is predicted at stated assumptions (``DEEPSPEED_ASSUMED``) and never used to judge a constant.

Every prediction is ``estimate(...).time`` on the catalog GPU (basis "catalog GPU, parts model,
uncalibrated"). Error = predicted tokens/s / published − 1 (positive: memfit thinks the run faster than
it was). Per group the median and max |error|, and per model the Kendall tau of predicted vs published
tokens/s order (what decides the planner's ranking).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from bench import gpu_published as gp
from bench.time_grid import kendall_tau

from memfit.estimate import DEFAULT_PROFILE, estimate
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy

HERE = Path(__file__).resolve().parent

GPU_CHECKS = sorted((HERE / "results").glob("gpu_check_h200_2026-11-30*.json"))
# DeepSpeed issue 3901 publishes the engine only: micro-batch 1, bf16 mixed precision, checkpointing and
# SDPA are assumptions (a 7B full fine-tune at 4k on 40 GB cards); the param-only offload row is not a
# memfit strategy (offload is none | optimizer | optimizer+params)
DEEPSPEED_ASSUMED = {
    "deepspeed-issue3901-falcon7b-4k-fsdp": {"fsdp": "full_shard"},
    "deepspeed-issue3901-falcon7b-4k-zero2-offload": {"zero_stage": 2, "offload": "optimizer"},
    "deepspeed-issue3901-falcon7b-4k-zero3": {"zero_stage": 3},
    "deepspeed-issue3901-falcon7b-4k-zero3-offload-params": None,
    "deepspeed-issue3901-falcon7b-4k-zero3-offload-opt-params": {"zero_stage": 3, "offload": "optimizer+params"},
}
ASSUMED = dict(method="full", micro_batch_size=1, grad_accum=1, seq_len=4096, gradient_checkpointing=True,
               attention="sdpa", precision="bf16-mixed")


@dataclass
class TimedCase:
    case: gp.Case  # model, hardware, strategy (bench/gpu_published.py)
    published_tps: float  # tokens/s over all GPUs
    published_step: float  # seconds per optimizer step
    source: str  # group label in the tables
    note: str = ""


def tokens_per_step(case: gp.Case) -> float:
    s = case.strategy
    return float(s.micro_batch_size * s.grad_accum * s.seq_len * case.hardware.world_size)


def load_published(path: Path) -> tuple[list[TimedCase], list[dict]]:
    """Rows with a published throughput or step time and status success."""
    cases, skipped = [], []
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        tps, step = row.get("train_tokens_per_second"), row.get("step_time_s")
        if not (tps or step) or (row.get("status") or "").lower() != "success":
            continue
        try:
            case = gp.convert(row) if row["id"] not in DEEPSPEED_ASSUMED else _assumed(row)
        except gp.Skip as why:
            skipped.append({"id": row["id"], "group": row["source_group"], "why": str(why)})
            continue
        tokens = tokens_per_step(case)
        tps = float(tps) if tps else tokens / float(step)
        note = "assumed mb 1, gc, sdpa, bf16-mixed" if row["id"] in DEEPSPEED_ASSUMED else ""
        cases.append(TimedCase(case, tps, tokens / tps, row["source_group"], note))
    return cases, skipped


def _assumed(row: dict) -> gp.Case:
    engine = DEEPSPEED_ASSUMED[row["id"]]
    if engine is None:
        raise gp.Skip("ZeRO-3 with parameter offload only is not a memfit strategy")
    return gp.Case(row["id"], row["source_group"], gp.MODELS[row["model"]], gp._hardware(row, None),
                   Strategy(**ASSUMED, **engine), "none", None, "success", row.get("reliability") or "")


def load_gpu_checks(paths: list[Path]) -> list[TimedCase]:
    """memfit's own H200 runs: one case per record (load_gpu_check's allocated-metric case)."""
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        steps = {r["name"]: r["measured"].get("step_seconds") for r in data["records"]}
        tag = path.stem.removeprefix("gpu_check_h200_2026-11-30").lstrip("_") or "first"
        for case in gp.load_gpu_check(path):
            name = case.id.removeprefix(f"{case.group}-")
            if "#" in case.id or not steps.get(name):
                continue
            step = float(steps[name])
            out.append(TimedCase(replace(case, id=f"h200/{tag}/{name}"), tokens_per_step(case) / step, step,
                                 case.group))
    return out


def predict(tc: TimedCase, profile=DEFAULT_PROFILE) -> dict:
    c = tc.case
    prof = profile.with_values(**c.overrides) if c.overrides else profile
    t = estimate(resolve_model(c.model), c.hardware, c.strategy, profile=prof, margin=0.0).time
    s = c.strategy
    return {"id": c.id, "group": tc.source, "method": s.method, "model": c.model,
            "gpus": f"{c.hardware.world_size}x{c.hardware.gpu.name}", "engine": s.label(),
            "mb": s.micro_batch_size, "ga": s.grad_accum, "seq": s.seq_len, "note": tc.note,
            "predicted_tps": t["tokens_per_second"], "published_tps": tc.published_tps,
            "predicted_step_s": t["step_seconds"], "published_step_s": tc.published_step,
            "error": t["tokens_per_second"] / tc.published_tps - 1.0, "basis": t["basis"],
            "parts_s": {k.removesuffix("_seconds"): t[k] for k in
                        ("matmul_seconds", "attention_seconds", "memory_bound_seconds", "dequant_seconds",
                         "dispatch_seconds", "optimizer_seconds", "comm_exposed_seconds", "offload_seconds",
                         "upload_seconds", "cpu_optimizer_seconds") if t[k]}}


def summarize(rows: list[dict]) -> dict:
    absd = [abs(r["error"]) for r in rows]
    taus = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        if len(mine) >= 2:
            taus[model] = {"n": len(mine), "tau": kendall_tau([r["predicted_tps"] for r in mine],
                                                              [r["published_tps"] for r in mine])}
    return {"rows": len(rows), "median_abs": statistics.median(absd) if absd else None,
            "max_abs": max(absd) if absd else None,
            "median_signed": statistics.median(r["error"] for r in rows) if rows else None, "kendall": taus}


def run(path: Path, checks: list[Path], profile=DEFAULT_PROFILE) -> dict:
    cases, skipped = load_published(path)
    cases += load_gpu_checks(checks)
    rows = [predict(tc, profile) for tc in cases]
    groups = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    return {"rows": rows, "skipped": skipped, "groups": {g: summarize(v) for g, v in groups.items()}}


def _fmt(x: float) -> str:
    return f"{x:9.0f}" if x >= 100 else f"{x:9.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=gp.DEFAULT_FILE, help="published runs (JSON lines)")
    ap.add_argument("--gpu-check", type=Path, action="append", default=None,
                    help="memfit's own GPU runs (bench/gpu_check.py JSON; default: the H200 runs of 2026-11-30)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.file.is_file():
        print(f"error: --file {args.file}: no such file; point it at gpu-runs/public.jsonl", file=sys.stderr)
        return 2
    out = run(args.file, GPU_CHECKS if args.gpu_check is None else args.gpu_check)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    basis = {r["basis"] for r in out["rows"]}
    print(f"time basis: {', '.join(sorted(basis))}; error = predicted tok/s / published - 1")
    for group, summary in out["groups"].items():
        rows = [r for r in out["rows"] if r["group"] == group]
        print(f"\n{group} ({rows[0]['gpus']})")
        print(f"  {'row':58s} {'method':6s} {'model':13s} {'mb x ga':>7s} {'seq':>5s} {'pred tok/s':>10s}"
              f" {'pub tok/s':>9s} {'err %':>7s} {'pred s':>7s} {'pub s':>7s}")
        for r in rows:
            rid = r["id"].removeprefix("fms-main-").removeprefix("deepspeed-issue3901-")
            print(f"  {rid[:58]:58s} {r['method']:6s} {r['model'][:13]:13s} {r['mb']:>3d} x {r['ga']:<2d}"
                  f" {r['seq']:5d} {_fmt(r['predicted_tps']):>10s} {_fmt(r['published_tps'])}"
                  f" {100 * r['error']:+7.1f} {r['predicted_step_s']:7.2f} {r['published_step_s']:7.2f}"
                  + (f"  ({r['note']})" if r["note"] else ""))
        taus = ", ".join(f"{m} {k['tau']:+.2f} (n={k['n']})" for m, k in summary["kendall"].items())
        print(f"  |error| median {100 * summary['median_abs']:.1f} %, max {100 * summary['max_abs']:.1f} %, "
              f"signed median {100 * summary['median_signed']:+.1f} % (n={summary['rows']}); "
              f"Kendall tau by model: {taus or '-'}")
    for s in out["skipped"]:
        print(f"\nskipped {s['id']}: {s['why']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
