"""memfit held against published long-context runs (../shared/reference/long-context/public-long-context.jsonl:
ALST's tables, the HF Ulysses blog, axolotl's activation-offloading PRs, torchtitan's context parallelism, NeMo,
EasyContext, Ulysses-Offload, Liger). Development rows: the mapping (bench/long_context_rows.py) was decided
with them in view (bench/provenance.json, group "long-context"), nothing is fitted to them.

    PYTHONPATH=. .venv/bin/python bench/long_context.py            # tables per metric, summary, rows not stated
    PYTHONPATH=. .venv/bin/python bench/long_context.py --json     # write bench/results/long_context.json
    PYTHONPATH=. .venv/bin/python bench/long_context.py --check    # exit 1 when that file is stale

Per metric, on the row's own reading:
  * reserved / peak_unspecified: memfit's per-GPU reserved peak (torch max_memory_reserved), or the nvidia-smi
    level (reserved + CUDA context + NCCL buffers) for a peak whose reading is not named;
  * max_seq_len: the longest seq_len memfit calls fitting (``estimate(..., margin=0).fits``: the card's whole
    usable memory and the node's CPU RAM, the row's strategy, no evaluation phase: the runs evaluate nothing),
    by bisection between 1024 and 16M tokens in
    steps the levers allow (a multiple of the Ulysses degree, of 2 x the CP degree);
  * tokens_per_s: tokens per optimizer step / memfit's step time (data-parallel replicas x micro-batch x
    accumulation x seq_len; per GPU or the pool's total as the row's unit says); s_per_step: the step time;
    tflops: the row's FLOP formula (Megatron-LM's model FLOPs with recompute, 96 B s l h^2 (1 + s/6h +
    V/16lh), Narayanan et al. 2021 eq. 3, as ALST reports) over memfit's step time, per GPU.
Error = (memfit - published) / published.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from memfit.estimate import DEFAULT_PROFILE, estimate
from memfit.spec.phases import EvalSpec, RunPhases

from bench import provenance
from bench.long_context_rows import DEFAULT_FILE, GROUP, Case, load

HERE = Path(__file__).resolve().parent
SHIPPED = HERE / "results" / "long_context.json"
# what estimate / plan show beside an estimate that uses a long-context lever (memfit.estimate.accuracy)
ESTIMATE_FILE = HERE.parent / "memfit" / "estimate" / "long_context_accuracy.json"
COMMAND = "PYTHONPATH=. .venv/bin/python bench/long_context.py --json"
MIN_LEN, MAX_LEN = 1024, 16 * 2**20
MEMORY = ("reserved", "nvidia-smi")
TIME = ("tokens_per_s", "s_per_step", "tflops")
TARGETS = {"memory_median_abs_pct": 10.0, "memory_max_abs_pct": 25.0, "longest_median_abs_pct": 15.0,
           "tokens_per_s_median_abs_pct": 20.0}  # issue #36's "done when"


# the published runs benchmark training and evaluate nothing: no evaluation phase in the verdict
NO_EVAL = RunPhases(eval=EvalSpec(enabled=False))


def _estimate(case: Case, seq_len: int | None = None):
    s = case.strategy if seq_len is None else case.strategy.model_copy(update={"seq_len": int(seq_len)})
    profile = DEFAULT_PROFILE.with_values(**case.overrides) if case.overrides else DEFAULT_PROFILE
    return estimate(case.model, case.hardware, s, profile=profile, margin=0.0, phases=NO_EVAL)


def memory(case: Case) -> float:
    est = _estimate(case)
    mem = est.to_dict()["memory"]
    reserved = float(mem["gpu_reserved_bytes"])
    if case.metric == "reserved":
        return reserved
    over = mem["gpu_overhead_bytes"]
    return reserved + float(over["cuda_context"]) + float(over["nccl_buffers"])


def length_step(case: Case) -> int:
    """The granularity a length must keep: a multiple of the Ulysses degree, of 2 x the CP degree."""
    s = case.strategy
    return max(s.sequence_parallel, 2 * s.context_parallel if s.context_parallel > 1 else 1)


def longest_fitting(case: Case) -> tuple[int | None, str]:
    """The longest seq_len in [MIN_LEN, MAX_LEN] memfit calls fitting; (None, 'below') when MIN_LEN does not,
    (MAX_LEN, 'above') when MAX_LEN does."""
    g = length_step(case)

    def fits(n: int) -> bool:
        return _estimate(case, n).fits

    lo = -(-MIN_LEN // g) * g
    hi = MAX_LEN // g * g
    if not fits(lo):
        return None, "below"
    if fits(hi):
        return hi, "above"
    while hi - lo > g and hi > lo * 1.0005:  # lo fits, hi does not
        mid = int((lo * hi) ** 0.5) // g * g
        if mid <= lo or mid >= hi:
            mid = (lo + hi) // 2 // g * g
            if mid <= lo:
                break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, ""


def megatron_flops(case: Case) -> float:
    """Model FLOPs of one step with full recompute (Megatron-LM, Narayanan et al. 2021 eq. 3)."""
    m, s = case.model, case.strategy
    batch = case.data_parallel * s.micro_batch_size * s.grad_accum
    seq, h, layers = s.seq_len, m.hidden, m.layers
    return 96.0 * batch * seq * layers * h * h * (1 + seq / (6 * h) + m.vocab / (16 * layers * h))


def time_value(case: Case) -> float:
    step = _estimate(case).step_seconds
    s = case.strategy
    if case.metric == "s_per_step":
        return step
    if case.metric == "tflops":
        return megatron_flops(case) / (case.hardware.world_size * step) / 1e12
    tokens = case.data_parallel * s.micro_batch_size * s.grad_accum * s.seq_len / step
    return tokens / case.hardware.world_size if case.per_gpu else tokens


def predict(case: Case) -> dict:
    out = {"id": case.id, "source": case.source, "metric": case.metric, "published": case.published,
           "strategy": case.strategy.label(), "hardware": case.hardware.describe(), "notes": case.notes}
    if case.metric in MEMORY:
        out["memfit"] = memory(case)
    elif case.metric == "max_seq_len":
        out["memfit"], out["bound"] = longest_fitting(case)
    else:
        out["memfit"] = time_value(case)
    value = out["memfit"]
    out["error"] = -1.0 if value is None else (value - case.published) / case.published
    return out


def _stats(results: list[dict]) -> dict:
    errs = [r["error"] for r in results]
    if not errs:
        return {"compared": 0}
    absd = [abs(e) for e in errs]
    return {"compared": len(errs), "median_abs_pct": round(100 * statistics.median(absd), 1),
            "max_abs_pct": round(100 * max(absd), 1), "median_signed_pct": round(100 * statistics.median(errs), 1)}


def _sig(x, digits: int = 4):
    return None if x is None else float(f"{x:.{digits}g}")


def summarize(results: list[dict], skipped: list[dict], total: int) -> dict:
    record = provenance.load()
    by = {k: [r for r in results if r["metric"] in ks] for k, ks in
          (("memory", MEMORY), ("longest", ("max_seq_len",)), ("tokens_per_s", ("tokens_per_s",)),
           ("s_per_step", ("s_per_step",)), ("tflops", ("tflops",)), ("time", TIME))}
    stats = {k: _stats(v) for k, v in by.items()}
    figures = {"memory_median_abs_pct": stats["memory"].get("median_abs_pct"),
               "memory_max_abs_pct": stats["memory"].get("max_abs_pct"),
               "longest_median_abs_pct": stats["longest"].get("median_abs_pct"),
               "tokens_per_s_median_abs_pct": stats["tokens_per_s"].get("median_abs_pct")}
    cats: dict = {}
    for s in skipped:
        cats[s["category"]] = cats.get(s["category"], 0) + 1
    return {
        "command": COMMAND, "source": DEFAULT_FILE.name, "group": GROUP,
        "basis": {side: provenance.basis(side, [GROUP], record)["basis"] for side in ("memory", "time")},
        "rows": total, "stated": len(results), "not_stated": len(skipped),
        "figures": figures, "targets": TARGETS,
        "meets": {k: (v is not None and v <= TARGETS[k]) for k, v in figures.items()},
        "by_metric": stats,
        "stated_rows": [{"id": r["id"], "metric": r["metric"], "published": _sig(r["published"]),
                         "memfit": _sig(r["memfit"]), "error_pct": round(100 * r["error"], 1),
                         **({"bound": r["bound"]} if r.get("bound") else {}),
                         **({"notes": r["notes"]} if r["notes"] else {})} for r in results],
        "not_stated_by_category": dict(sorted(cats.items(), key=lambda kv: (-kv[1], kv[0]))),
        "not_stated_rows": [{"id": s["id"], "category": s["category"], "reasons": s["reasons"]} for s in skipped],
    }


FLOOR = "published peak below its setup's states"


def states_floor(case: Case) -> float:
    """Per-GPU bytes of the weights, gradients and optimizer states of the run as mapped: all live at the optimizer
    step, whatever the activations."""
    g = _estimate(case).to_dict()["memory"]["gpu_bytes"]
    return g["weights"] + g["gradients"] + g["optimizer"]


def below_floor(cases: list[Case]) -> tuple[list[Case], list[dict]]:
    """Memory rows a setup cannot have produced: where one published peak is below :func:`states_floor`, the
    source left out a lever that ran (an 8-bit optimizer, offload, sharding), so every memory row of that source,
    model and pool is not stated. (cases kept, rows not stated)."""
    bad: dict = {}
    for c in cases:
        floor = states_floor(c) if c.metric in MEMORY else 0.0
        if c.published < floor:
            bad.setdefault((c.source, c.model.name, c.hardware.describe()), (c, floor))
    kept, skipped = [], []
    for c in cases:
        hit = bad.get((c.source, c.model.name, c.hardware.describe())) if c.metric in MEMORY else None
        if hit is None:
            kept.append(c)
            continue
        first, floor = hit
        skipped.append({"id": c.id, "source": c.source, "metric": c.metric, "category": FLOOR, "reasons": [
            f"{first.id} published {first.published / 1e9:.1f} GB, below the {floor / 1e9:.1f} GB of weights, "
            f"gradients and optimizer states its setup as published holds ({first.strategy.label()}): a lever the "
            "source does not name ran (an 8-bit optimizer, offload, sharding)"]})
    return kept, skipped


def run(path: Path = DEFAULT_FILE) -> tuple[list[dict], list[dict], dict]:
    cases, skipped = load(path)
    cases, floor = below_floor(cases)
    skipped += floor
    results = [predict(c) for c in cases]
    return results, skipped, summarize(results, skipped, len(cases) + len(skipped))


def _fmt(metric: str, x) -> str:
    if x is None:
        return "<1024"
    if metric in MEMORY:
        return f"{x / 1e9:.1f} GB"
    if metric == "max_seq_len":
        return f"{x / 1e3:,.0f}k"
    if metric == "s_per_step":
        return f"{x:,.1f} s"
    if metric == "tflops":
        return f"{x:.0f}"
    return f"{x:,.0f}"


def report(results: list[dict], skipped: list[dict], summary: dict) -> None:
    titles = {"memory": "per-GPU memory (reserved, or nvidia-smi level for an unnamed peak)",
              "longest": "longest seq_len memfit calls fitting vs the published longest",
              "tokens_per_s": "tokens/s (per GPU or total, as the row says)", "s_per_step": "seconds per step",
              "tflops": "TFLOPS per GPU (Megatron-LM model FLOPs with recompute / memfit's step time)"}
    groups = {"memory": MEMORY, "longest": ("max_seq_len",), "tokens_per_s": ("tokens_per_s",),
              "s_per_step": ("s_per_step",), "tflops": ("tflops",)}
    for key, metrics in groups.items():
        rows = [r for r in results if r["metric"] in metrics]
        if not rows:
            continue
        print(f"\n{titles[key]}")
        print(f"  {'row':28s} {'published':>12s} {'memfit':>12s} {'error':>8s}  strategy / hardware")
        for r in rows:
            extra = f" ({r['bound']} the search range)" if r.get("bound") else ""
            print(f"  {r['id']:28s} {_fmt(r['metric'], r['published']):>12s} {_fmt(r['metric'], r['memfit']):>12s} "
                  f"{100 * r['error']:+7.1f}%  {r['strategy']} on {r['hardware']}{extra}")
    s, t = summary["by_metric"], summary["targets"]

    def line(name: str, key: str, stat: str, target: str | None) -> str:
        v = s[key].get(stat)
        tgt = f" (target <= {t[target]:g} %)" if target else ""
        shown = f"{v:.1f} %" if v is not None else "n/a"
        return f"  {name:34s} {shown:>9s}{tgt}  over {s[key]['compared']} figure(s)"

    print(f"\nsummary ({summary['stated']} of {summary['rows']} rows stated; labels: memory "
          f"{summary['basis']['memory']}, time {summary['basis']['time']})")
    print(line("memory median |error|", "memory", "median_abs_pct", "memory_median_abs_pct"))
    print(line("memory max |error|", "memory", "max_abs_pct", "memory_max_abs_pct"))
    print(line("longest fitting median |error|", "longest", "median_abs_pct", "longest_median_abs_pct"))
    print(line("tokens/s median |error|", "tokens_per_s", "median_abs_pct", "tokens_per_s_median_abs_pct"))
    print(line("s/step median |error|", "s_per_step", "median_abs_pct", None))
    print(line("TFLOPS median |error|", "tflops", "median_abs_pct", None))
    print(line("time (all three) median |error|", "time", "median_abs_pct", None))
    print(f"\nnot stated: {summary['not_stated']} rows")
    for cat, n in summary["not_stated_by_category"].items():
        ids = [x["id"] for x in skipped if x["category"] == cat]
        print(f"  {n:3d}  {cat}: {', '.join(ids)}")
    print("  (every reason per row: --json's not_stated_rows)")


def for_estimates(summary: dict) -> dict:
    """The figures an estimate with a long-context lever shows (memfit/estimate/long_context_accuracy.json)."""
    by = summary["by_metric"]
    return {"command": COMMAND.removesuffix(" --json"), "source": summary["source"], "basis": summary["basis"],
            "rows": summary["rows"], "stated": summary["stated"],
            "memory": by["memory"], "longest": by["longest"], "s_per_step": by["s_per_step"],
            "tokens_per_s": by["tokens_per_s"], "targets": summary["targets"], "meets": summary["meets"]}


def _stale(path: Path, want: dict) -> list[str]:
    shipped = json.loads(path.read_text()) if path.is_file() else {}
    want = json.loads(json.dumps(want))
    return [k for k in want if shipped.get(k) != want[k]] + [k for k in shipped if k not in want]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", nargs="?", const=str(SHIPPED), help="write the summary (default %(const)s)")
    ap.add_argument("--check", nargs="?", const=str(SHIPPED), help="exit 1 when the shipped summary is stale")
    ap.add_argument("--file", default=str(DEFAULT_FILE), help="the published rows")
    args = ap.parse_args(argv)
    results, skipped, summary = run(Path(args.file))
    if args.check:
        stale = [(p, d) for p, d in ((Path(args.check), _stale(Path(args.check), summary)),
                                     (ESTIMATE_FILE, _stale(ESTIMATE_FILE, for_estimates(summary)))) if d]
        for path, diff in stale:
            print(f"{path} is stale ({', '.join(diff)} differ); regenerate: {COMMAND}")
        if not stale:
            print(f"{args.check} and {ESTIMATE_FILE.name} are current")
        return 1 if stale else 0
    report(results, skipped, summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
        ESTIMATE_FILE.write_text(json.dumps(for_estimates(summary), indent=1) + "\n")
        print(f"\nwrote {args.json} and {ESTIMATE_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
