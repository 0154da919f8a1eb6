"""Where a CPU training process's RSS goes: `memfit train` runs traced (bench/studies/rss_trace/sitecustomize.py).

    OMP_NUM_THREADS=1 PYTHONPATH=. nice -n 19 .venv/bin/python bench/studies/rss_breakdown.py
        # 8 configs x 2 allocators, ~12 min
    PYTHONPATH=. .venv/bin/python bench/studies/rss_breakdown.py --configs auto --malloc default

Model and data as bench/studies/auto_vs_default.py (Llama-style h 256 / 4 layers, vocab 480, fp32, 8 sequences of
512 tokens per optimizer step). Each configuration trains through `python -m memfit train RUN --json` in its
own process, with a tracer that samples /proc/self/statm every 2 ms and glibc's mallinfo2 at each new RSS
high and at train begin / step begin / step end. ``--malloc``: ``default`` = glibc as a user's shell starts
it (dynamic mmap threshold), ``bench`` = MALLOC_MMAP_THRESHOLD_=32 MiB (what bench/time_grid.py sets and
bench/studies/auto_vs_default.py's subprocesses inherit), ``measure`` = 65536 (memfit.measure.probe).

Prints, per run: the estimate (tensor peak = the "gpu" lines on the CPU pseudo-device; process line) and
measured peak RSS, split into file-backed (shared libraries) and anonymous; the anonymous RSS at train
begin (process + model + data, before any step); glibc's heap in use / free and mmapped bytes at the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CONFIGS = {  # name -> strategy fields (fp32, seq 512, 8 sequences per step)
    "auto": dict(method="full", gradient_checkpointing=False, attention="sdpa", micro_batch_size=8, grad_accum=1),
    "lora-gc-mb1": dict(method="lora", gradient_checkpointing=True, attention="sdpa", micro_batch_size=1, grad_accum=8),
    "full-mb2": dict(method="full", gradient_checkpointing=False, attention="sdpa", micro_batch_size=2, grad_accum=4),
    "lora-eager-mb4": dict(method="lora", gradient_checkpointing=False, attention="eager", micro_batch_size=4,
                           grad_accum=2),
    "lora-sdpa-mb4": dict(method="lora", gradient_checkpointing=False, attention="sdpa", micro_batch_size=4,
                          grad_accum=2),
    "full-eager-mb4": dict(method="full", gradient_checkpointing=False, attention="eager", micro_batch_size=4,
                           grad_accum=2),
    # full-gc-mb8 chose the term's form (layer activations, not the peak); lora-gc-mb8 was held out (+17 %)
    "full-gc-mb8": dict(method="full", gradient_checkpointing=True, attention="sdpa", micro_batch_size=8,
                        grad_accum=1),
    "lora-gc-mb8": dict(method="lora", gradient_checkpointing=True, attention="eager", micro_batch_size=8,
                        grad_accum=1),
}
MALLOC = {"default": None, "bench": str(32 << 20), "measure": "65536"}


def run_one(name: str, malloc: str, args, model: Path, data: Path) -> dict:
    from bench.studies.auto_vs_default import _common

    from memfit.spec.run import run_from_dict, save_run

    strategy = dict(CONFIGS[name], seq_len=args.seq_len, precision="fp32")
    tag = f"{name}-{malloc}"
    raw = {"model": str(model), "hardware": "local", "data": {"path": str(data)}, "strategy": strategy,
           "output_dir": str(args.work / tag)}
    path = save_run(run_from_dict(raw, source=tag), args.work / f"{tag}.yaml")
    trace = args.work / f"{tag}.trace.json"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if MALLOC[malloc]:
        env["MALLOC_MMAP_THRESHOLD_"] = MALLOC[malloc]
    env.update(PYTHONPATH=f"{HERE / 'rss_trace'}:{HERE.parents[1]}", MEMFIT_RSS_TRACE=str(trace))
    out = subprocess.run([sys.executable, "-m", "memfit", "train", str(path), *_common(args.steps), "--overwrite",
                          "--json"], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{tag} failed: {out.stderr[-1500:]}")
    text = out.stdout
    summary = json.loads(text[text.find("{"):])
    return {"summary": summary, "trace": json.loads(trace.read_text()), "strategy": strategy}


def estimate_of(model_dir: Path, strategy: dict) -> dict:
    from memfit.estimate.estimate import estimate
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model
    from memfit.spec.strategy import Strategy

    est = estimate(resolve_model(str(model_dir)), parse_hardware("local"), Strategy(**strategy))
    return {"tensors": est.gpu_allocated, "process": est.cpu_total, "total": est.gpu_allocated + est.cpu_total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--malloc", default="default,bench")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--work", type=Path, default=Path("/tmp/memfit-rss-breakdown"))
    ap.add_argument("--models", type=Path, default=Path("/tmp/memfit-time-grid-models"))
    args = ap.parse_args()
    from bench.time_grid import build_models, text_data

    model = build_models(args.models)["llama"]
    data = text_data(args.work / "data.jsonl", 8 * (args.steps + 2), args.seq_len)
    mb = 1e6
    print(f"{'run':24s} {'est tens':>8s} {'est tot':>8s} {'peak RSS':>8s} {'err':>6s} {'file':>6s} {'anon':>6s} "
          f"{'anon@begin':>10s} {'heap used':>9s} {'heap free':>9s} {'mmapped':>8s}  (MB)")
    results = {}
    for name in args.configs.split(","):
        for malloc in args.malloc.split(","):
            r = run_one(name, malloc, args, model, data)
            est = estimate_of(model, r["strategy"])
            tr, peak = r["trace"], r["summary"]["peak_mem_bytes"]
            p = tr["peak"]
            begin = next((m for m in tr["marks"] if m["what"] == "train_begin"), {})
            results[f"{name}-{malloc}"] = {"estimate": est, "peak_rss": peak, "trace_peak": p, "train_begin": begin,
                                           "marks": tr["marks"]}
            print(f"{name + ' ' + malloc:24s} {est['tensors'] / mb:8.0f} {est['total'] / mb:8.0f} {peak / mb:8.0f} "
                  f"{(est['total'] - peak) / peak * 100:+5.1f}% {p['file'] / mb:6.0f} {p['anon'] / mb:6.0f} "
                  f"{begin.get('anon', 0) / mb:10.0f} {p['heap_used'] / mb:9.0f} {p['heap_free'] / mb:9.0f} "
                  f"{p['mmapped'] / mb:8.0f}", flush=True)
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
