"""memfit's predicted tokens/s per GPU against published GPU throughputs (gpu-runs/public-time.jsonl).

    PYTHONPATH=. .venv/bin/python bench/public_time.py                  # table per group (median, max, tau, worst rows)
    PYTHONPATH=. .venv/bin/python bench/public_time.py --rows           # + every row: published, predicted, error
    PYTHONPATH=. .venv/bin/python bench/public_time.py --group torchtitan --json
    PYTHONPATH=. .venv/bin/python bench/public_time.py --compiled       # also torch.compile rows, predicted as eager

Rows become memfit runs in bench/public_time_rows.py (its docstring lists every mapping rule and the row
fields it reads). ``predict`` is ``estimate(...).time["tokens_per_second"]`` (all GPUs, every position of
micro-batch x seq_len) / world size x the case's ``counted_fraction`` (the published figure's tokens per
processed position: < 1 where the source counts only non-padding tokens). err = predicted / published - 1
(positive: memfit thinks the run faster than it was). Per group: n, median and max |err|, the signed errors,
and Kendall tau (bench/time_grid.py's tau-a) of predicted vs published order per model group (rows of one
source sharing model, GPU kind and count) with >= 3 rows; "all" pools every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.public_time_rows import DEFAULT_FILE, TimeCase, load  # noqa: F401  (the API: load, predict, score)
from bench.time_grid import kendall_tau

from memfit.estimate import DEFAULT_PROFILE, estimate

HERE = Path(__file__).resolve().parent

MIN_TAU_ROWS = 3


def predict(case: TimeCase, profile=DEFAULT_PROFILE) -> float:
    """Predicted tokens/s per GPU, counted as the published figure counts them."""
    prof = profile.with_values(**case.overrides) if case.overrides else profile
    t = estimate(case.model, case.hardware, case.strategy, profile=prof, margin=0.0).time
    return t["tokens_per_second"] / case.hardware.world_size * case.counted_fraction


def _summary(cases: list[TimeCase], preds: list[float]) -> dict:
    errs = {c.id: p / c.published_tps_per_gpu - 1.0 for c, p in zip(cases, preds)}
    absd = [abs(e) for e in errs.values()]
    taus = {}
    for mg in sorted({c.model_group for c in cases}):
        idx = [i for i, c in enumerate(cases) if c.model_group == mg]
        if len(idx) >= MIN_TAU_ROWS:
            taus[mg] = {"n": len(idx), "tau": kendall_tau([preds[i] for i in idx],
                                                          [cases[i].published_tps_per_gpu for i in idx])}
    return {"n": len(cases), "median_abs": statistics.median(absd) if absd else None,
            "max_abs": max(absd) if absd else None,
            "median_signed": statistics.median(errs.values()) if errs else None, "signed": errs, "kendall": taus}


def _group(c: TimeCase) -> str:
    """The row's source group; method=peft rows (any other PEFT method) apart from the named methods'."""
    return f"{c.group} (peft)" if c.strategy.method == "peft" else c.group


def score(cases: list[TimeCase], preds: list[float]) -> dict:
    """{group: {n, median_abs, max_abs, median_signed, signed {id: err}, kendall {model_group: {n, tau}}},
    "all": the named methods' rows (method=peft rows in their own "<group> (peft)" lines)}"""
    out = {}
    for g in sorted({_group(c) for c in cases}):
        idx = [i for i, c in enumerate(cases) if _group(c) == g]
        out[g] = _summary([cases[i] for i in idx], [preds[i] for i in idx])
    named = [i for i, c in enumerate(cases) if c.strategy.method != "peft"]
    out["all"] = _summary([cases[i] for i in named], [preds[i] for i in named])
    return out


def _pct(x) -> str:
    return "     -" if x is None else f"{100 * x:+6.1f}%"


def _rows(cases: list[TimeCase], preds: list[float]) -> list[dict]:
    return [{"id": c.id, "group": c.group, "model_group": c.model_group, "strategy": c.strategy.label(),
             "mb": c.strategy.micro_batch_size, "seq": c.strategy.seq_len, "published": c.published_tps_per_gpu,
             "predicted": p, "err": p / c.published_tps_per_gpu - 1.0, "reliability": c.reliability, "note": c.note}
            for c, p in zip(cases, preds)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE, help="public-time.jsonl (default: %(default)s)")
    ap.add_argument("--group", action="append", help="only this source_group (repeatable)")
    ap.add_argument("--rows", action="store_true", help="print every row")
    ap.add_argument("--worst", type=int, default=3, help="worst rows shown per group (default: %(default)s)")
    ap.add_argument("--compiled", action="store_true", help="map torch.compile rows too (predicted as eager)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.file.is_file():
        print(f"error: --file {args.file}: no such file; point it at gpu-runs/public-time.jsonl", file=sys.stderr)
        return 2
    cases, skipped = load(args.file, compiled=args.compiled)
    if args.group:
        cases = [c for c in cases if c.group in args.group]
        skipped = [s for s in skipped if s["group"] in args.group]
    preds = [predict(c) for c in cases]
    scores, rows = score(cases, preds), _rows(cases, preds)
    if args.json:
        print(json.dumps({"score": scores, "rows": rows, "skipped": skipped}, indent=1))
        return 0
    print("err = predicted tok/s per GPU / published - 1 (tokens counted as the source counts them)\n")
    print(f"{'group':20s} {'n':>4s} {'skip':>4s} {'median|e|':>9s} {'max|e|':>8s} {'median':>8s}")
    for g, s in scores.items():
        nskip = len(skipped) if g == "all" else sum(1 for x in skipped if x["group"] == g)
        med = "-" if s["median_abs"] is None else f"{100 * s['median_abs']:.1f}%"
        mx = "-" if s["max_abs"] is None else f"{100 * s['max_abs']:.1f}%"
        print(f"{g:20s} {s['n']:4d} {nskip:4d} {med:>9s} {mx:>8s} {_pct(s['median_signed']):>8s}")
    for g, s in scores.items():
        if g == "all":
            continue
        print(f"\n{g}: Kendall tau by model group: " + (", ".join(
            f"{mg.split('/', 1)[1]} {k['tau']:+.2f} (n={k['n']})" for mg, k in s["kendall"].items()) or "-"))
        mine = sorted((r for r in rows if r["group"] == g), key=lambda r: -abs(r["err"]))
        for r in mine[:args.worst]:
            print(f"  worst {r['id'][:64]:64s} {r['published']:8.0f} pub {r['predicted']:8.0f} pred {_pct(r['err'])}")
    if args.rows:
        print(f"\n{'row':70s} {'strategy':28s} {'mb':>3s} {'seq':>5s} {'published':>9s} {'predicted':>9s} {'err':>7s}")
        for r in rows:
            print(f"{r['id'][:70]:70s} {r['strategy'][:28]:28s} {r['mb']:3d} {r['seq']:5d} {r['published']:9.0f}"
                  f" {r['predicted']:9.0f} {_pct(r['err'])}" + (f"  ({r['note']})" if r["note"] else ""))
    reasons: dict[str, int] = {}
    for s in skipped:
        reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
    print(f"\nskipped {len(skipped)} rows:")
    for why, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:3d}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
