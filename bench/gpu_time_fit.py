"""The GPU time model (memfit.steptime) against every published GPU throughput memfit can express: the few
free constants fitted, leave-one-group-out figures, the seed's runtime findings, and the error bars
`estimate` / `plan` show.

    PYTHONPATH=. .venv/bin/python bench/gpu_time_fit.py          # tables: in-sample and left out per group, seeds
    PYTHONPATH=. .venv/bin/python bench/gpu_time_fit.py --rows   # + every row
    PYTHONPATH=. .venv/bin/python bench/gpu_time_fit.py --write  # + rewrite steptime/published_time_accuracy.json
    PYTHONPATH=. .venv/bin/python bench/gpu_time_fit.py --check  # exit 1 when that file differs from what this computes

Rows: gpu-runs/public-time.jsonl (bench/public_time_rows.py maps them), IBM fms-acceleration's A100 rows and
memfit's own H200 checks (bench/gpu_time_published.py). Judged: every row whose source reliability is not
'low' (the DeepSpeed issue's rows, whose batch and settings were not published, are printed apart).

method=peft rows (PEFT's method comparison: any PEFT method from its own config) are scored, never fitted:
the constants stay those of the named methods, the tables above them cover the named methods, and the
PEFT methods get their own table and their own error bar ("peft, 1 GPU").

Fitting: only the constants in FITTED (a grid each, coordinate descent, two rounds), to the mean over groups
of each group's median |log(predicted / published)| (every group weighs the same, however many rows it
has). Held out: each group's rows predicted with the constants fitted on the other groups. Kendall tau per
model group ranks distinct configurations (repeated runs of one configuration: their median).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from bench import gpu_time_published as gtp, holdout_score, noise, provenance, public_time
from bench.public_time_rows import DEFAULT_FILE, TimeCase, load
from bench.time_grid import kendall_tau

from memfit.estimate import DEFAULT_PROFILE
from memfit.estimate.accuracy import run_kind
from memfit.spec.model import resolve_model
from memfit.steptime.accuracy import DATA as ACCURACY_FILE

HERE = Path(__file__).resolve().parent

FITTED = {
    "gemm_max_fraction": [0.7, 0.75, 0.8, 0.85, 0.9],  # bounded by the best published fraction (A100 0.87)
    "matmul_sustained_fraction": [0.75, 0.8, 0.85, 0.9, 0.95, 1.0],
    "bandwidth_half_bytes": [0.25e6, 0.5e6, 1e6, 2e6, 4e6],
}
MIN_TAU = 3


def own_rows() -> list[TimeCase]:
    """fms-main's A100 rows and memfit's H200 checks as TimeCases (bench/gpu_time_published.py's loaders)."""
    out = []
    timed, _ = gtp.load_published(gtp.gp.DEFAULT_FILE) if gtp.gp.DEFAULT_FILE.is_file() else ([], [])
    for tc in timed + gtp.load_gpu_checks(gtp.GPU_CHECKS):
        if tc.source == "deepspeed":  # the same runs as public-time.jsonl's deepspeed rows
            continue
        c = tc.case
        kind = c.hardware.gpu.name
        out.append(TimeCase(id=c.id, group=tc.source,
                            model_group=f"{tc.source}/{c.model}/{kind} x{c.hardware.world_size}",
                            model=resolve_model(c.model), hardware=c.hardware, strategy=c.strategy,
                            published_tps_per_gpu=tc.published_tps / c.hardware.world_size, tokens_counted="all",
                            reliability=c.reliability or ("low" if tc.note else "high"), note=tc.note))
    return out


def all_rows(path: Path = DEFAULT_FILE) -> list[TimeCase]:
    public = load(path)[0] if path.is_file() else []
    return public + own_rows()


def predict(case: TimeCase, profile=DEFAULT_PROFILE) -> float:
    return public_time.predict(case, profile)


def judged(cases: list[TimeCase]) -> list[TimeCase]:
    return [c for c in cases if c.reliability != "low"]


def named(cases: list[TimeCase]) -> list[TimeCase]:
    """The rows of memfit's named methods (full, LoRA, QLoRA, DoRA): what the fit reads and the main tables show."""
    return [c for c in cases if c.strategy.method != "peft"]


def _loss(cases: list[TimeCase], profile) -> float:
    groups: dict[str, list[float]] = {}
    for c in cases:
        groups.setdefault(c.group, []).append(abs(math.log(predict(c, profile) / c.published_tps_per_gpu)))
    return statistics.fmean(statistics.median(v) for v in groups.values())


def fit(cases: list[TimeCase], base=DEFAULT_PROFILE, rounds: int = 2) -> dict:
    """The FITTED constants minimising _loss on ``cases``' named-method rows (coordinate descent from the
    Profile's values)."""
    cases = named(cases)
    values = {k: getattr(base, k) for k in FITTED}
    for _ in range(rounds):
        for name, grid in FITTED.items():
            best = min(grid, key=lambda v: _loss(cases, base.with_values(**{**values, name: v})))
            values[name] = best
    return values


def _key(c: TimeCase) -> tuple:
    s = c.strategy
    return (c.model_group, s.label(), s.micro_batch_size, s.seq_len, s.grad_accum, s.lora_r, s.lora_targets)


def summary(cases: list[TimeCase], preds: list[float]) -> dict:
    errs = [p / c.published_tps_per_gpu - 1.0 for c, p in zip(cases, preds)]
    taus = {}
    for mg in sorted({c.model_group for c in cases}):
        configs: dict[tuple, tuple[list, list]] = {}
        for c, p in zip(cases, preds):
            if c.model_group == mg:
                pub, pred = configs.setdefault(_key(c), ([], []))
                pub.append(c.published_tps_per_gpu)
                pred.append(p)
        if len(configs) >= MIN_TAU:
            pubs = [statistics.median(v[0]) for v in configs.values()]
            prds = [statistics.median(v[1]) for v in configs.values()]
            taus[mg] = {"configs": len(configs), "tau": kendall_tau(prds, pubs)}
    absd = [abs(e) for e in errs]
    return {"n": len(cases), "median_abs": statistics.median(absd) if absd else None,
            "max_abs": max(absd) if absd else None, "median_signed": statistics.median(errs) if errs else None,
            "kendall": taus}


def by_group(cases: list[TimeCase], preds: list[float]) -> dict:
    out = {g: summary([c for c in cases if c.group == g], [p for c, p in zip(cases, preds) if c.group == g])
           for g in sorted({c.group for c in cases})}
    out["all"] = summary(cases, preds)
    return out


def held_out(cases: list[TimeCase]) -> tuple[list[float], dict]:
    """Each group's rows predicted with FITTED refitted on the other groups; the constants per left-out group."""
    preds: dict[str, float] = {}
    fits = {}
    for g in sorted({c.group for c in cases}):
        values = fit([c for c in cases if c.group != g])
        fits[g] = values
        prof = DEFAULT_PROFILE.with_values(**values)
        for c in cases:
            if c.group == g:
                preds[c.id] = predict(c, prof)
    return [preds[c.id] for c in cases], fits


def kinds(cases: list[TimeCase], preds: list[float], record: dict) -> dict:
    """Leave-one-group-out error ranges per kind of run (method x engine family x offload, as the memory bars),
    each with its basis from bench/provenance.json and the hand-set constants it rests on."""
    out: dict[str, list[float]] = {}
    groups: dict[str, set] = {}
    for c, p in zip(cases, preds):
        s = c.strategy
        kind = run_kind(s.method, s.zero_stage, s.fsdp, s.offload, c.hardware.world_size)
        out.setdefault(kind, []).append(100.0 * (p / c.published_tps_per_gpu - 1.0))
        groups.setdefault(kind, set()).add(c.group)
    return {k: {"rows": len(v), "min_pct": round(min(v), 1), "max_pct": round(max(v), 1),
                "median_abs_pct": round(statistics.median(abs(x) for x in v), 1), "groups": sorted(groups[k]),
                **provenance.basis("time", groups[k], record)} for k, v in sorted(out.items())}


def noise_floor(cases: list[TimeCase]) -> dict:
    """Published tokens/s of one configuration measured more than once (other days or versions): their spread."""
    return noise.floor((noise.config_key(c.model_group, c.hardware, c.strategy), c.published_tps_per_gpu)
                       for c in cases)


def peft_methods(cases: list[TimeCase], preds: list[float]) -> dict:
    """Per PEFT method (method=peft rows): the error range and median |error|, as kinds() gives them."""
    out: dict[str, list[float]] = {}
    for c, p in zip(cases, preds):
        if c.strategy.method == "peft":
            out.setdefault(gtp.gp.peft_type(c), []).append(100.0 * (p / c.published_tps_per_gpu - 1.0))
    return {k: {"rows": len(v), "min_pct": round(min(v), 1), "max_pct": round(max(v), 1),
                "median_abs_pct": round(statistics.median(abs(x) for x in v), 1)} for k, v in sorted(out.items())}


def accuracy(cases: list[TimeCase], record: dict | None = None) -> dict:
    """What published_time_accuracy.json holds: the leave-one-group-out ranges per kind (method=peft's
    included) with their basis, the overall figures of the named methods' rows, the PEFT methods one by one,
    the noise floor of repeated configurations, and the fit."""
    record = provenance.load() if record is None else record
    jud = judged(cases)
    preds, fits = held_out(jud)
    five = [i for i, c in enumerate(jud) if c.strategy.method != "peft"]
    overall = by_group([jud[i] for i in five], [preds[i] for i in five])["all"]
    return {"procedure": "leave-one-group-out over published GPU throughputs (bench/gpu_time_fit.py): "
                         + ", ".join(FITTED) + " refitted without the row's source group",
            "rows": len(five), "groups": sorted({c.group for c in jud}),
            "median_abs_pct": round(100 * overall["median_abs"], 1), "max_abs_pct": round(100 * overall["max_abs"], 1),
            **provenance.basis("time", {jud[i].group for i in five}, record),
            "noise_floor": noise_floor(jud),
            "held_out_readings": [r for r in holdout_score.readings() if r["side"] == "time"],
            "overall_is": "the named methods' rows (full, LoRA, QLoRA, DoRA); method=peft rows are scored apart",
            "fitted": {k: getattr(DEFAULT_PROFILE, k) for k in FITTED}, "kinds": kinds(jud, preds, record),
            "by_group": group_table([jud[i] for i in five], [preds[i] for i in five], record),
            "peft_methods": peft_methods(jud, preds),
            "command": "PYTHONPATH=. .venv/bin/python bench/gpu_time_fit.py --write"}


def group_table(cases: list[TimeCase], left_out: list[float], record: dict) -> dict:
    """Per source group of the named methods' rows: in-sample and left-out median / max |error| (%), its basis,
    and Kendall tau per model group (in-sample)."""
    ins, out = by_group(cases, [predict(c) for c in cases]), by_group(cases, left_out)
    def pair(s: dict) -> list:
        return [round(100 * s["median_abs"], 1), round(100 * s["max_abs"], 1)]

    return {g: {"rows": ins[g]["n"], "in_sample": pair(ins[g]), "left_out": pair(out[g]),
                "basis": provenance.basis("time", {c.group for c in cases} if g == "all" else {g}, record)["basis"],
                "kendall": {} if g == "all" else {mg.split("/", 1)[1]: [round(k["tau"], 2), k["configs"]]
                                                  for mg, k in ins[g]["kendall"].items()}} for g in ins}


def _pct(x) -> str:
    return "      -" if x is None else f"{100 * x:+6.1f}%"


def _table(title: str, scores: dict) -> list[str]:
    lines = [title, f"  {'group':22s} {'n':>3s} {'median|e|':>9s} {'max|e|':>8s} {'signed':>8s}  Kendall tau (configs)"]
    for g, s in scores.items():
        taus = ", ".join(f"{mg.split('/', 1)[1]} {k['tau']:+.2f} ({k['configs']})" for mg, k in s["kendall"].items())
        lines.append(f"  {g:22s} {s['n']:3d} {100 * s['median_abs']:8.1f}% {100 * s['max_abs']:7.1f}% "
                     f"{_pct(s['median_signed'])}  {taus if g != 'all' else ''}")
    return lines


def _peft_table(peft: list) -> list[str]:
    """method=peft rows left out (constants fitted without their group; development), one line per PEFT method."""
    table = peft_methods(*zip(*peft))
    errs = [abs(p / c.published_tps_per_gpu - 1) for c, p in peft]
    lines = ["\nmethod=peft rows (any PEFT method from its config; scored, never fitted; development), "
             f"left out: {len(peft)} "
             f"rows, median |e| {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}%",
             f"  {'PEFT method':18s} {'n':>3s} {'range':>17s} {'median|e|':>9s}"]
    for k, v in table.items():
        lines.append(f"  {k:18s} {v['rows']:3d} {v['min_pct']:+7.1f}..{v['max_pct']:+7.1f}% "
                     f"{v['median_abs_pct']:8.1f}%")
    return lines


def main(argv=None) -> int:
    from bench import seed_time_checks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--rows", action="store_true", help="print every row")
    ap.add_argument("--write", action="store_true", help=f"rewrite {ACCURACY_FILE.name}")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when {ACCURACY_FILE.name} is stale")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.file.is_file():
        print(f"error: --file {args.file}: no such file; point it at gpu-runs/public-time.jsonl", file=sys.stderr)
        return 2
    cases = all_rows(args.file)
    if args.check:
        return check(cases)
    scored, low = judged(cases), [c for c in cases if c.reliability == "low"]
    all_out, fits = held_out(scored)
    jud = named(scored)
    in_preds = [predict(c) for c in jud]
    out_preds = [p for c, p in zip(scored, all_out) if c.strategy.method != "peft"]
    peft = [(c, p) for c, p in zip(scored, all_out) if c.strategy.method == "peft"]
    acc = accuracy(cases) if args.write else None
    seeds = seed_time_checks.run()
    if args.json:
        print(json.dumps({"in_sample": by_group(jud, in_preds), "held_out": by_group(jud, out_preds), "fits": fits,
                          "peft_methods_held_out": peft_methods(*zip(*peft)) if peft else {},
                          "seed_checks": seeds}, indent=1, default=str))
    else:
        print("err = predicted tokens/s per GPU / published - 1; fitted: " + ", ".join(
            f"{k} {getattr(DEFAULT_PROFILE, k):g}" for k in FITTED) + "\n")
        print("\n".join(_table("in-sample (the Profile's constants, fitted on every group):", by_group(jud, in_preds))))
        print("\n".join(_table("\nleft out (each group predicted with the constants fitted on the others; "
                               "development groups):", by_group(jud, out_preds))))
        for g, v in fits.items():
            print(f"  without {g}: " + ", ".join(f"{k} {x:g}" for k, x in v.items()))
        if low:
            lp = [predict(c) for c in low]
            print("\nlow reliability (settings not published; not judged): " + ", ".join(
                f"{c.id} {_pct(p / c.published_tps_per_gpu - 1)}" for c, p in zip(low, lp)))
        if peft:
            print("\n".join(_peft_table(peft)))
        f = noise_floor(scored)
        print(f"\nnoise floor: {f['configs']} configurations published more than once differ by median "
              f"{f['median_spread_pct']} %, up to {f['max_spread_pct']} % (bench/noise.py)")
        for r in holdout_score.readings():
            if r["side"] == "time":
                print(f"held out, scored once ({r['source']}, frozen at {r['frozen_commit'][:7]}): first reading "
                      f"median {r['first']['median_abs_pct']} %, max {r['first']['max_abs_pct']} %; now "
                      f"{r['current']['median_abs_pct']} %")
        print("\nseed 000 (arXiv 2406.02290) runtime findings, predicted on its setup:")
        for s in seeds:
            print(f"  {'PASS' if s['ok'] else 'FAIL'}  {s['finding']}: {s['detail']}")
        if args.rows:
            print(f"\n{'row':64s} {'strategy':26s} {'mb':>3s} {'seq':>5s} {'published':>9s} {'in':>7s} {'held':>7s}")
            for c, a, b in zip(jud, in_preds, out_preds):
                print(f"{c.id[:64]:64s} {c.strategy.label()[:26]:26s} {c.strategy.micro_batch_size:3d} "
                      f"{c.strategy.seq_len:5d} {c.published_tps_per_gpu:9.0f} {_pct(a / c.published_tps_per_gpu - 1)}"
                      f" {_pct(b / c.published_tps_per_gpu - 1)}")
    if acc is not None:
        ACCURACY_FILE.write_text(json.dumps(acc, indent=1) + "\n")
        print(f"\nwrote {ACCURACY_FILE}", file=sys.stderr)
    return 0


def check(cases: list[TimeCase]) -> int:
    """1 (and one line) when the committed accuracy file differs from what the bench computes now."""
    try:
        committed = json.loads(ACCURACY_FILE.read_text())
    except (OSError, ValueError):
        committed = {}
    now = accuracy(cases)
    if committed != now:
        print(f"error: {ACCURACY_FILE.name} is stale (its held-out time error bars differ from the bench's); "
              "run: PYTHONPATH=. python bench/gpu_time_fit.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from memfit.methods.peft.count import save_counts

    code = main()
    save_counts()  # the PEFT counts this run made, for the next one (pricing itself writes nothing)
    sys.exit(code)
