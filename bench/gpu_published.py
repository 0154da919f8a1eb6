"""memfit's estimate held against published GPU fine-tuning runs (../shared/reference/gpu-runs/public.jsonl).

    PYTHONPATH=. .venv/bin/python bench/gpu_published.py            # table per group + overall
    PYTHONPATH=. .venv/bin/python bench/gpu_published.py --rows     # + every row
    PYTHONPATH=. .venv/bin/python bench/gpu_published.py --json     # machine-readable
    PYTHONPATH=. .venv/bin/python bench/gpu_published.py --write-accuracy   # regenerate what estimate/plan print
    PYTHONPATH=. .venv/bin/python bench/gpu_published.py --check    # exit 1 when that file is stale

Every row memfit can express becomes (ModelSpec from a preset, HardwareSpec, Strategy) and is predicted;
the prediction is compared on the metric the row published: ``torch.cuda.max_memory_allocated`` with
the estimate's allocated peak, ``max_memory_reserved`` with its reserved peak, ``nvidia-smi`` (or an
unnamed system figure) with reserved + CUDA context + NCCL. Rows that ran out of memory must be
predicted not to fit (GPU memory over the card, margin 0: the strict reading); rows that ran must not be
called not fitting by the planner (over the card less the planner's margin, ``PLANNER_MARGIN``: what
``memfit plan`` would refuse). ``capacity_boundary`` rows (the longest sequence that trained on a card of
that size) are compared with the card's size. Rows memfit cannot
express are listed with the missing feature. Signed error = (predicted − measured) / measured: negative
means memfit under-predicts (the costly mistake). The leave-one-group-out figures refit the estimator's
fitted global constants (``FITTED``) on all groups but one and report the error on the one left out; the
error bars ``estimate``/``plan`` print (``memfit/estimate/published_accuracy.json``) are those held-out
predictions per kind of run, with the in-sample ones (the Profile's defaults) beside them.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import statistics
import sys
from pathlib import Path

from memfit.estimate import DEFAULT_PROFILE, estimate
from memfit.plan import plan as _plan
from memfit.spec.model import resolve_model

from bench.gpu_published_rows import (DEFAULT_FILE, GPUS, MODELS, UNSUPPORTED, Case, Skip, _bytes, _engine,  # noqa: F401
                                      _hardware, _method, _metric, _precision, convert, load, load_gpu_check)
from bench import holdout_score, noise, provenance

HERE = Path(__file__).resolve().parent

# the Profile constants fitted to published GPU runs (the rest are read from the engines' code)
ACCURACY_FILE = HERE.parent / "memfit" / "estimate" / "published_accuracy.json"
FITTED = ("fragmentation", "allocator_cached_layers", "allocator_cached_loss")
# the fraction of each GPU the planner keeps free (memfit plan's --margin default): a run that ran and is
# predicted over the card less this margin is a wrong verdict the user would get
PLANNER_MARGIN = float(inspect.signature(_plan).parameters["margin"].default)
FIT_GRID = {"fragmentation": [i / 100 for i in range(2, 8)], "allocator_cached_layers": [i / 4 for i in range(1, 7)],
            "allocator_cached_loss": [i / 4 for i in range(0, 5)]}


def predict(case: Case, profile=DEFAULT_PROFILE) -> dict:
    if case.overrides:
        profile = profile.with_values(**case.overrides)
    est = estimate(resolve_model(case.model), case.hardware, case.strategy, profile=profile, margin=0.0)
    mem = est.to_dict()["memory"]
    alloc = float(mem["gpu_allocated_bytes"])
    reserved = float(mem["gpu_reserved_bytes"])
    smi = reserved + est.gpu_overhead["cuda_context"] + est.gpu_overhead["nccl_buffers"]
    value = {"allocated": alloc, "reserved": reserved}.get(case.metric, smi)
    card = case.hardware.gpu.memory_bytes
    # what the estimator's verdict holds: the card's needs (the cache the allocator frees on demand left out)
    held = max(float(mem["gpu_needed_bytes"]), est.gpu_loading + est.gpu_overhead["cuda_context"])
    fits = held <= card
    # what memfit plan says with its margin (a run that ran must not be refused)
    planner_fits = held <= card * (1.0 - PLANNER_MARGIN)
    err = None if case.measured is None else (value - case.measured) / case.measured
    ok = (not fits) if case.status == "oom" else fits if case.status == "boundary" else planner_fits
    return {"id": case.id, "group": case.group, "metric": case.metric, "status": case.status,
            "predicted": value, "measured": case.measured, "error": err, "fits": fits,
            "planner_fits": planner_fits, "verdict_ok": ok,
            "allocated": alloc, "reserved": reserved, "nvidia_smi": smi, "strategy": case.strategy.label(),
            "attention_backend": mem["attention_backend"], "reliability": case.reliability}


def summarize(results: list[dict]) -> dict:
    errs = [r["error"] for r in results if r["error"] is not None]
    absd = [abs(x) for x in errs]
    return {"rows": len({r["id"].split("#")[0] for r in results}), "compared": len(errs),
            "median_abs": statistics.median(absd) if absd else None, "max_abs": max(absd) if absd else None,
            "median_signed": statistics.median(errs) if errs else None,
            "under_5": [r["id"] for r in results if r["error"] is not None and r["error"] < -0.05],
            "under_10": [r["id"] for r in results if r["error"] is not None and r["error"] < -0.10],
            "oom_called_fitting": [r["id"] for r in results if r["status"] == "oom" and r["fits"]],
            "ran_called_not_fitting": sorted({r["id"].split("#")[0] for r in results
                                              if r["status"] == "success" and not r["planner_fits"]}),
            "boundary_over_card": [r["id"] for r in results if r["status"] == "boundary" and not r["fits"]]}


def _grid() -> list[dict]:
    out = [{}]
    for name in FITTED:
        out = [{**d, name: v} for d in out for v in FIT_GRID[name]]
    return out


def _fit_cases(cases: list[Case]) -> list[Case]:
    """The rows a fit reads: measured, not on allocated bytes (which do not depend on ``FITTED``), and of
    the named methods: method=peft rows (any PEFT method from its config) are scored, never fitted, so the
    Profile's constants stay those of the five methods and every PEFT figure is out of the fit."""
    return [c for c in cases if c.measured is not None and c.metric != "allocated" and c.strategy.method != "peft"]


def peft_type(case) -> str | None:
    """'IA3', 'LOHA', ... for a method=peft case (memory or time: anything with a ``strategy``), else None."""
    return json.loads(case.strategy.peft_config)["peft_type"] if case.strategy.method == "peft" else None


def by_peft_method(cases: list[Case], results: list[dict], in_sample: list[dict], record: dict) -> dict:
    """Per PEFT method (method=peft rows): the held-out signed error range, median |error|, the figures more
    than 10 % under, and the in-sample range beside it."""
    out: dict = {}
    for i, c in enumerate(cases):
        kind = peft_type(c)
        if kind is not None and results[i]["error"] is not None:
            out.setdefault(kind, []).append(i)
    return {k: {**_range([results[i]["error"] for i in idx]),
                "under_10": sum(results[i]["error"] < -0.10 for i in idx),
                "basis": provenance.basis("memory", {cases[i].group for i in idx}, record)["basis"],
                "in_sample": _range([in_sample[i]["error"] for i in idx])} for k, idx in sorted(out.items())}


def grid_scores(cases: list[Case]) -> list[tuple[dict, list[float]]]:
    """Every grid point's weighted |error| per fitted row (one pass over the grid, shared by the fits):
    an under-prediction counts twice (it is the costly mistake)."""
    use = _fit_cases(cases)
    out = []
    for values in _grid():
        prof = DEFAULT_PROFILE.with_values(**values)
        errs = [predict(c, prof)["error"] for c in use]
        out.append((values, [abs(x) * (2.0 if x < 0 else 1.0) for x in errs]))
    return out


def fit(cases: list[Case], leave_out: str | None = None, scores: list | None = None) -> tuple[dict, dict]:
    """The FITTED values (grid) with the least mean |error| over the groups other than ``leave_out``, an
    under-prediction counting twice (it is the costly mistake); rows comparing allocated bytes do not
    depend on these constants and are left out of the fit. Ties go to the first grid point. ``scores``:
    ``grid_scores(cases)`` when several fits share them."""
    use = _fit_cases(cases)
    keep = [i for i, c in enumerate(use) if c.group != leave_out]
    best, best_score = {}, None
    for values, per_row in scores if scores is not None else grid_scores(cases):
        score = statistics.fmean(per_row[i] for i in keep) if keep else 0.0
        if best_score is None or score < best_score - 1e-12:
            best, best_score = values, score
    return best, {"fit_score": best_score, "rows": len(keep)}


def held_out(cases: list[Case]) -> tuple[list[dict], dict, dict]:
    """Every case predicted with ``FITTED`` refitted on the other groups (leave-one-group-out), in the
    order of ``cases``; the values fitted per group left out; the fit on every group (value, info)."""
    scores = grid_scores(cases)
    fitted = {g: fit(cases, leave_out=g, scores=scores)[0] for g in sorted({c.group for c in cases})}
    profiles = {g: DEFAULT_PROFILE.with_values(**v) for g, v in fitted.items()}
    return [predict(c, profiles[c.group]) for c in cases], fitted, fit(cases, scores=scores)


def leave_one_group_out(cases: list[Case], held: tuple | None = None) -> dict:
    """For each group: fit FITTED on the other groups, report the error on the group left out."""
    held, fitted, (values, info) = held if held is not None else held_out(cases)
    table = {}
    for g in sorted({c.group for c in cases if c.measured is not None}):
        s = summarize([r for r in held if r["group"] == g])
        table[g] = {"fitted": fitted[g], "median_abs": s["median_abs"], "max_abs": s["max_abs"],
                    "under_10": len(s["under_10"]), "oom_called_fitting": len(s["oom_called_fitting"]),
                    "ran_called_not_fitting": len(s["ran_called_not_fitting"])}
    table["(all groups)"] = {"fitted": values, "default": {n: getattr(DEFAULT_PROFILE, n) for n in FITTED}, **info}
    return table


def _range(errs: list[float]) -> dict:
    return {"figures": len(errs), "min_pct": round(100 * min(errs), 1), "max_pct": round(100 * max(errs), 1),
            "median_abs_pct": round(100 * statistics.median(abs(x) for x in errs), 1)}


def by_kind(cases: list[Case], results: list[dict], in_sample: list[dict] | None = None,
            record: dict | None = None) -> dict:
    """Signed error range per kind of run (memfit.estimate.accuracy.run_kind: method x engine family x one
    or several GPUs) over every compared figure of ``results``, the wrong fit verdicts among its runs,
    (``record`` given) its label from bench/provenance.json, and (``in_sample`` given) the same range from
    those predictions."""
    from memfit.estimate.accuracy import run_kind

    groups: dict = {}
    for i, c in enumerate(cases):
        s = c.strategy
        groups.setdefault(run_kind(s.method, s.zero_stage, s.fsdp, s.offload, c.hardware.world_size), []).append(i)
    out = {}
    for kind, idx in sorted(groups.items()):
        compared = [i for i in idx if results[i]["error"] is not None and cases[i].status != "boundary"]
        if not compared:
            continue
        summary = summarize([results[i] for i in idx])
        entry = {**_range([results[i]["error"] for i in compared]),
                 "rows": len({cases[i].id.split("#")[0] for i in compared}),
                 "groups": sorted({cases[i].group for i in compared}),
                 "under_10": len(summary["under_10"]),
                 "oom_called_fitting": len(summary["oom_called_fitting"]),
                 "ran_called_not_fitting": len(summary["ran_called_not_fitting"]),
                 "verdicts": len({cases[i].id.split("#")[0] for i in idx if cases[i].status in ("oom", "success")})}
        if record is not None:
            entry.update(provenance.basis("memory", entry["groups"], record))
        if in_sample is not None:
            entry["in_sample"] = {**_range([in_sample[i]["error"] for i in compared]), "basis": "in_sample"}
        out[kind] = entry
    return out


def default_checks(path: Path) -> list[Path]:
    """memfit's own GPU check joins the published file it was fitted with (the default), not another."""
    if path != DEFAULT_FILE:
        return []
    return sorted(p for p in (HERE / "results").glob("gpu_check_*.json") if "categories" not in p.name)


def accuracy(path: Path = DEFAULT_FILE, checks: list[Path] | None = None, *, cases: list[Case] | None = None,
             held: tuple | None = None, record: dict | None = None) -> dict:
    """What ``memfit/estimate/published_accuracy.json`` holds (without its date): per kind of run, the
    leave-one-group-out error range with its basis (bench/provenance.py), the in-sample range at the Profile's defaults,
    and the wrong fit verdicts of the held-out predictions."""
    checks = default_checks(path) if checks is None else checks
    if cases is None:
        cases = load(path)[0] + [c for p in checks for c in load_gpu_check(Path(p))]
    results, fitted, (all_fit, _) = held if held is not None else held_out(cases)
    in_sample = [predict(c) for c in cases]
    record = provenance.load() if record is None else record
    kinds = by_kind(cases, results, in_sample, record)
    return {"source": "bench/gpu_published.py",
            "command": "PYTHONPATH=. .venv/bin/python bench/gpu_published.py --write-accuracy",
            "files": [Path(path).name, *(Path(p).name for p in checks)],
            "procedure": "leave-one-group-out: " + ", ".join(FITTED) + " refitted without the row's source group; "
                         "in_sample: the Profile's defaults, fitted on every group",
            "labels": "basis per kind from bench/provenance.json: held_out only for groups no constant, rule, "
                      "mapping or row choice was decided after seeing; else development",
            **provenance.basis("memory", {c.group for c in cases}, record),
            "noise_floor": noise_floor(cases),
            "overall": {"left_out": _overall(cases, results), "in_sample": _overall(cases, in_sample)},
            "groups_left_out": _groups(cases, results, record),
            "groups_in_sample": _groups(cases, in_sample, record, basis="in_sample"),
            "counts": _counts(cases),
            "held_out_readings": [r for r in holdout_score.readings() if r["side"] == "memory"],
            "rows": sum(v["rows"] for v in kinds.values()),  # runs with a compared figure
            "figures": sum(v["figures"] for v in kinds.values()),
            "groups": sorted({c.group for c in cases}),
            "planner_margin": PLANNER_MARGIN,
            "fitted_all_groups": all_fit, "profile": {n: getattr(DEFAULT_PROFILE, n) for n in FITTED},
            "fitted_per_group_left_out": fitted,
            "kinds": kinds,
            "peft_methods": by_peft_method(cases, results, in_sample, record)}


def _overall(cases: list[Case], results: list[dict]) -> dict:
    """What README quotes: every compared figure's median and max |error|, and the wrong verdicts."""
    s = summarize(results)
    runs = {c.id.split("#")[0]: c.status for c in cases}
    return {"figures": s["compared"], "median_abs_pct": round(100 * s["median_abs"], 1),
            "max_abs_pct": round(100 * s["max_abs"], 1), "under_10": len(s["under_10"]),
            "oom_runs": sum(v == "oom" for v in runs.values()), "oom_called_fitting": len(s["oom_called_fitting"]),
            "ran_runs": sum(v == "success" for v in runs.values()),
            "ran_called_not_fitting": len(s["ran_called_not_fitting"])}


def _groups(cases: list[Case], results: list[dict], record: dict, basis: str | None = None) -> dict:
    """Per source group, its figures' errors in ``results`` and their basis (``basis`` given: that one, e.g.
    in_sample for the Profile's defaults; else the group's from bench/provenance.json)."""
    out = {}
    for g in sorted({c.group for c in cases}):
        mine = [r for r in results if r["group"] == g]
        if any(r["error"] is not None for r in mine):
            out[g] = {**_overall([c for c in cases if c.group == g], mine),
                      "basis": basis or provenance.group_basis("memory", g, record)}
    return out


def _counts(cases: list[Case]) -> dict:
    public = {c.id.split("#")[0] for c in cases if not c.group.startswith("gpu-check")}
    peft = {c.id.split("#")[0]: peft_type(c) for c in cases if c.strategy.method == "peft"}
    return {"published_runs": len(public), "peft_runs": len(peft), "peft_methods": len(set(peft.values())),
            "gpu_check_runs": len({c.id.split("#")[0] for c in cases if c.group.startswith("gpu-check")})}


def noise_floor(cases: list[Case]) -> dict:
    """The spread of one configuration measured more than once in the published rows (bench/noise.py)."""
    return noise.floor((noise.config_key(c.model, c.hardware, c.strategy, c.metric), c.measured) for c in cases
                       if c.status == "success" and c.measured is not None and c.metric != "capacity")


def _first_difference(a, b, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{where}{k}: {'missing' if k not in a else a[k]} -> {'missing' if k not in b else b[k]}"
            diff = _first_difference(a[k], b[k], f"{where}{k}.")
            if diff:
                return diff
        return None
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return None if abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b)) else f"{where[:-1]}: {a} -> {b}"
    return None if a == b else f"{where[:-1]}: {a} -> {b}"


def check(path: Path = DEFAULT_FILE, committed: Path = ACCURACY_FILE, want: dict | None = None, **kw) -> str | None:
    """None when ``committed`` holds what the bench computes now (numbers compared, not the date); else
    one line saying what differs. ``want``: ``accuracy(path, **kw)`` when already computed."""
    try:
        have = json.loads(committed.read_text())
    except (OSError, ValueError) as err:
        return (f"{committed.name}: unreadable ({err}); regenerate: "
                "PYTHONPATH=. .venv/bin/python bench/gpu_published.py --write-accuracy")
    want = accuracy(path, **kw) if want is None else dict(want)
    have.pop("date", None)
    want.pop("date", None)
    diff = _first_difference(have, want)
    if diff is None:
        return None
    return (f"{committed.name} is stale ({diff}, committed -> computed now); regenerate: "
            "PYTHONPATH=. .venv/bin/python bench/gpu_published.py --write-accuracy")


def _pct(x) -> str:
    return "   -  " if x is None else f"{100 * x:+6.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE, help="published runs (JSON lines)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--gpu-check", type=Path, action="append", default=None,
                    help="also compare memfit's own trainer measured by bench/gpu_check.py (its JSON; default: "
                         "bench/results/gpu_check_*.json when present and --file is the default)")
    ap.add_argument("--rows", action="store_true", help="print every row")
    ap.add_argument("--no-logo", action="store_true", help="skip the leave-one-group-out refits")
    ap.add_argument("--write-accuracy", type=Path, nargs="?", const=ACCURACY_FILE, default=None,
                    help="write the held-out error per kind of run for memfit's estimate output (default: %(const)s)")
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 with one line when {ACCURACY_FILE.name} differs from what the bench computes now "
                         "(numbers, not the date)")
    args = ap.parse_args(argv)
    if not args.file.is_file():
        print(f"error: --file {args.file}: no such file; point it at gpu-runs/public.jsonl", file=sys.stderr)
        return 2
    checks = default_checks(args.file) if args.gpu_check is None else args.gpu_check
    if args.check:
        msg = check(args.file, checks=checks)
        print(msg or f"{ACCURACY_FILE.name} is current ({args.file.name} + {len(checks)} gpu-check file(s))",
              file=sys.stderr if msg else sys.stdout)
        return 1 if msg else 0
    cases, skipped = load(args.file)
    for path in checks:
        cases += load_gpu_check(Path(path))
    results = [predict(c) for c in cases]
    groups = sorted({r["group"] for r in results} | {s["group"] for s in skipped})
    per_group = {g: summarize([r for r in results if r["group"] == g]) for g in groups}
    for g in groups:
        per_group[g]["skipped"] = sum(1 for s in skipped if s["group"] == g)
    overall = summarize(results)
    overall["skipped"] = len(skipped)
    held = None if args.no_logo and not args.write_accuracy else held_out(cases)
    logo = {} if held is None else leave_one_group_out(cases, held)
    held_overall = None if held is None else summarize(held[0])
    acc = None if held is None else accuracy(args.file, checks, cases=cases, held=held)  # computed once
    kinds = by_kind(cases, results) if acc is None else acc["kinds"]
    if args.write_accuracy:
        data = {**{k: acc[k] for k in ("source", "command", "files")},
                "date": datetime.date.today().isoformat(), **acc}
        args.write_accuracy.write_text(json.dumps(data, indent=1) + "\n")
    if args.json:
        print(json.dumps({"overall": overall, "held_out_overall": held_overall, "groups": per_group, "rows": results,
                          "skipped": skipped, "leave_one_group_out": logo, "kinds": kinds,
                          "planner_margin": PLANNER_MARGIN}, indent=1))
        return 0
    print("in-sample (the Profile's defaults, whose " + ", ".join(FITTED) + " were fitted on every group):")
    print(f"{'group':14s} {'used':>4s} {'skip':>4s} {'cmp':>4s} {'median|e|':>9s} {'max|e|':>8s} {'median':>8s}"
          f" {'<-5%':>4s} {'<-10%':>5s} {'OOM fits':>8s} {'ran,no fit':>10s} {'bound>card':>10s}")
    rows = [*per_group.items(), ("overall", overall)]
    if held_overall is not None:
        rows.append(("left out", held_overall))
    for name, s in rows:
        med = "    -  " if s["median_abs"] is None else f"{100 * s['median_abs']:6.1f}%"
        mx = "    -  " if s["max_abs"] is None else f"{100 * s['max_abs']:6.1f}%"
        print(f"{name:14s} {s['rows']:4d} {s.get('skipped', 0):4d} {s['compared']:4d} {med:>9s} {mx:>8s}"
              f" {_pct(s['median_signed']):>8s} {len(s['under_5']):4d} {len(s['under_10']):5d}"
              f" {len(s['oom_called_fitting']):8d} {len(s['ran_called_not_fitting']):10d}"
              f" {len(s['boundary_over_card']):10d}")
    if args.rows:
        print("\nrow (metric, status): predicted / measured GB, error")
        for r in results:
            meas = "OOM" if r["measured"] is None else f"{r['measured'] / 1e9:7.2f}"
            print(f"  {r['id'][:70]:70s} {r['metric']:10s} {r['strategy'][:30]:30s} {r['predicted'] / 1e9:7.2f} / "
                  f"{meas:>7s} {_pct(r['error'])} fits={r['fits']}")
    under = [r for r in results if r["error"] is not None and r["error"] < -0.05]
    print("\nrows more than 5 % under their measurement:" + ("" if under else " none"))
    for r in under:
        print(f"  {r['id']}: {_pct(r['error'])} ({r['metric']}, {r['strategy']})")
    wrong = [r for r in results if r["verdict_ok"] is False and "#" not in r["id"]]  # each run once
    print(f"rows with the wrong fit verdict (OOM rows called fitting at margin 0; rows that ran called not fitting "
          f"at the planner's margin {PLANNER_MARGIN:g}; boundary rows predicted over their card):"
          + ("" if wrong else " none"))
    for r in wrong:
        print(f"  {r['id']}: {r['status']}, predicted {r['nvidia_smi'] / 1e9:.2f} GB with context"
              f" against a {_card(r, cases)} card -> fits={r['fits']}, planner fits={r['planner_fits']}")
    reasons: dict[str, int] = {}
    for s in skipped:
        reasons[s["why"]] = reasons.get(s["why"], 0) + 1
    print(f"\nskipped {len(skipped)} rows:")
    for why, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"  {count:3d}  {why}")
    if logo:
        print("\nleave-one-group-out (" + ", ".join(FITTED)
              + " fitted on the other groups; error on the one left out):")
        for g, f in logo.items():
            vals = ", ".join(f"{k}={v:g}" for k, v in f["fitted"].items())
            if g == "(all groups)":
                dflt = ", ".join(f"{k}={v:g}" for k, v in f["default"].items())
                print(f"  fitted on all groups: {vals} (Profile defaults: {dflt})")
                continue
            med = "-" if f["median_abs"] is None else f"{100 * f['median_abs']:.1f}%"
            mx = "-" if f["max_abs"] is None else f"{100 * f['max_abs']:.1f}%"
            print(f"  {g:14s} {vals}: median |e| {med}, max |e| {mx}, rows >10 % under: {f['under_10']}, "
                  f"OOM called fitting: {f['oom_called_fitting']}, "
                  f"ran called not fitting: {f['ran_called_not_fitting']}")
    if held is not None:
        print("\nper kind of run (what estimate/plan print): leave-one-group-out [basis] | in-sample")
        for kind, k in kinds.items():
            ins = k["in_sample"]
            print(f"  {kind:22s} {k['figures']:3d} figures, {k['rows']:3d} runs: "
                  f"{k['min_pct']:+6.1f} … {k['max_pct']:+6.1f} %"
                  f" (median |e| {k['median_abs_pct']:.1f} %) | {ins['min_pct']:+6.1f} … {ins['max_pct']:+6.1f} %"
                  f" (median |e| {ins['median_abs_pct']:.1f} %) [{k['basis']}]; wrong verdicts left out: "
                  f"{k['oom_called_fitting']} OOM called fitting, {k['ran_called_not_fitting']} ran called not fitting"
                  f" of {k['verdicts']}")
        _print_peft_methods(acc["peft_methods"])
        f = acc["noise_floor"]
        print(f"\nnoise floor: {f['configs']} configurations measured more than once differ by median "
              f"{f['median_spread_pct']} %, up to {f['max_spread_pct']} % (bench/noise.py)")
        for r in acc["held_out_readings"]:
            print(f"held out, scored once ({r['source']}, frozen at {r['frozen_commit'][:7]}): first reading median "
                  f"{r['first']['median_abs_pct']} %, max {r['first']['max_abs_pct']} %; "
                  f"now {r['current']['median_abs_pct']} %")
    return 0


def _print_peft_methods(methods: dict) -> None:
    print("\nper PEFT method (method=peft: scored, never fitted; development): left out | in-sample")
    for kind, k in methods.items():
        ins = k["in_sample"]
        print(f"  {kind:18s} {k['figures']:3d} figures: {k['min_pct']:+6.1f} … {k['max_pct']:+6.1f} % "
              f"(median |e| {k['median_abs_pct']:.1f} %, {k['under_10']} more than 10 % under) | "
              f"{ins['min_pct']:+6.1f} … {ins['max_pct']:+6.1f} %")


def _card(r: dict, cases: list[Case]) -> str:
    case = next(c for c in cases if c.id == r["id"])
    return f"{case.hardware.gpu.memory_bytes / 1e9:.1f} GB"


if __name__ == "__main__":
    from memfit.methods.peft.count import save_counts

    code = main()
    save_counts()  # the PEFT counts this run made, for the next one (pricing itself writes nothing)
    sys.exit(code)
