"""What planning buys: `memfit train --auto` against the popular default and the slowest plan that fits.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/auto_vs_default.py              # ~3 min quiet
    PYTHONPATH=. .venv/bin/python bench/studies/auto_vs_default.py --cap 1.2GB --sequences 8 --seq-len 512 --steps 6

Same model (the Llama-style h 256 / 4 layers of bench/time_grid.py, random weights), same synthetic
data, same tokens (``--sequences`` sequences of ``--seq-len`` tokens per optimizer step, ``--steps``
steps), the same RAM budget given to the planner (``--cap``, as `memfit train --auto --cpu-ram`):

* **auto** — `memfit train --auto --sequences-per-step N --cpu-ram CAP`: the planner picks method,
  checkpointing, attention and micro-batch × accumulation;
* **default** — LoRA + gradient checkpointing, micro-batch 1 with accumulation N (what guides suggest);
* **slowest** — the slowest combination the planner says fits under the cap (same search).

Each trains through `memfit train ... --json` in its own process; tokens/s = tokens per step / median
step time (first step left out), by wall clock and by process CPU time (the steadier figure on a shared
machine; equal to wall on a quiet one with one thread); peak RSS is the process's. Prints the predicted
figures beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the trained processes run glibc's malloc as a user's `memfit train` does (the estimator's CPU heap term
# describes that): not bench/time_grid.py's MALLOC_MMAP_THRESHOLD_ (its main sets it; kept out here too)
_USER_MALLOC = os.environ.get("MALLOC_MMAP_THRESHOLD_")


def _memfit(args: list[str]) -> dict:
    """Run `python -m memfit ARGS --json`; the summary object it prints."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if _USER_MALLOC is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = _USER_MALLOC
    out = subprocess.run([sys.executable, "-m", "memfit", *args, "--json"], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(HERE.parents[1])}, timeout=1800)
    text = out.stdout
    start = text.find("\n{") + 1 if not text.startswith("{") else 0
    if out.returncode != 0 or start < 0:
        raise SystemExit(f"memfit {' '.join(args)} failed (exit {out.returncode}): {out.stderr[-800:]}")
    return json.loads(text[start:])


def _common(steps: int) -> list[str]:
    sets = {"training.max_steps": steps, "training.checkpoint_interval": 0, "training.eval_interval": 0,
            "training.logging_interval": 1, "data.eval_fraction": 0.0, "data.format": "text",
            "data.packing": "false", "strategy.precision": "fp32"}
    # --overwrite: the bench's own run folders under --work from an earlier run are replaced
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")] + ["--overwrite"]


def _train_strategy(name: str, strategy: dict, args, model: Path, data: Path) -> dict:
    from memfit.spec.run import run_from_dict, save_run

    raw = {"model": str(model), "hardware": "local", "cpu_ram": args.cap, "data": {"path": str(data)},
           "strategy": strategy, "output_dir": str(args.work / name)}
    path = save_run(run_from_dict(raw, source=name), args.work / f"{name}.yaml")
    return _memfit(["train", str(path), *_common(args.steps)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", default="1.2GB", help="RAM budget given to the planner")
    ap.add_argument("--sequences", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--work", type=Path, default=Path("/tmp/memfit-auto-vs-default"))
    ap.add_argument("--models", type=Path, default=Path("/tmp/memfit-time-grid-models"))
    args = ap.parse_args()
    from bench.time_grid import build_models, text_data

    from memfit.plan.batch import plan_batch
    from memfit.spec.hardware import parse_hardware, parse_size
    from memfit.spec.model import resolve_model

    model = build_models(args.models)["llama"]
    data = text_data(args.work / "data.jsonl", args.sequences * (args.steps + 2), args.seq_len)
    from memfit.measure.hwcal import ensure_hardware_profile

    ensure_hardware_profile()
    hw = parse_hardware("local", cpu_ram=args.cap)
    p = plan_batch(resolve_model(str(model)), hw, seq_len=args.seq_len, sequences=args.sequences,
                   methods=["full", "lora", "qlora"])
    if p.recommended is None:
        raise SystemExit(f"nothing fits under {args.cap}; raise --cap")
    slow = p.candidates[-1].strategy.model_dump(mode="json")
    default = dict(method="lora", gradient_checkpointing=True, attention="sdpa", micro_batch_size=1,
                   grad_accum=args.sequences, seq_len=args.seq_len, precision="fp32")
    tokens = args.sequences * args.seq_len
    rows = []
    auto = _memfit(["train", "--auto", "--model", str(model), "--data", str(data), "--seq-len", str(args.seq_len),
                    "--sequences-per-step", str(args.sequences), "--cpu-ram", args.cap, "--methods", "full,lora,qlora",
                    "--out", str(args.work / "auto"), *_common(args.steps)])
    rows.append(("auto", auto))
    rows.append(("default", _train_strategy("default", default, args, model, data)))
    rows.append(("slowest", _train_strategy("slowest", slow, args, model, data)))
    cap = parse_size(args.cap)
    print(f"cap {args.cap}; {args.sequences} x {args.seq_len} tokens per step, {args.steps} steps; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; load {os.getloadavg()[0]:.1f}")
    print(f"{'run':8s} {'combination':44s} {'mb x ga':>7s} {'pred tok/s':>10s} {'tok/s':>8s} {'step ms':>8s} "
          f"{'tok/s CPU':>9s} {'CPU ms':>7s} {'peak RSS':>9s} {'<= cap':>6s}")
    wall, cpu = {}, {}
    for name, r in rows:
        pred = r.get("predicted") or {}
        st = pred.get("strategy") or {}
        step, cstep = r.get("step_time_s") or float("nan"), _cpu_step(r)
        wall[name], cpu[name] = tokens / step, tokens / cstep
        print(f"{name:8s} {r.get('method', ''):8s} {_label(st):35s} "
              f"{st.get('micro_batch_size', '?')}x{st.get('grad_accum', '?'):<5} "
              f"{(pred.get('time') or {}).get('tokens_per_second', float('nan')):10.0f} {wall[name]:8.0f} "
              f"{step * 1e3:8.0f} "
              f"{cpu[name]:9.0f} {cstep * 1e3:7.0f} {r['peak_mem_bytes'] / 1e9:7.2f}GB "
              f"{'yes' if r['peak_mem_bytes'] <= cap else 'NO':>6s}")
    for what, d in (("wall", wall), ("CPU time", cpu)):
        print(f"by {what}: auto / default {d['auto'] / d['default']:.2f}x (target >= 1.3x); "
              f"auto / slowest {d['auto'] / d['slowest']:.2f}x")
    print(f"time basis: {((rows[0][1].get('predicted') or {}).get('time') or {}).get('basis')}")
    return 0


def _cpu_step(summary: dict) -> float:
    """Median process CPU seconds per step (first left out), from the run's metrics.jsonl."""
    import statistics

    rows = [json.loads(x) for x in Path(summary["metrics_file"]).read_text().splitlines() if x.strip()]
    cpu = [r["step_cpu_s"] for r in rows if "step_cpu_s" in r]
    return statistics.median(cpu[1:] if len(cpu) > 2 else cpu) if cpu else float("nan")


def _label(st: dict) -> str:
    if not st:
        return "?"
    parts = [st.get("method", "?"), "gc" if st.get("gradient_checkpointing") else "no-gc", st.get("attention", "?")]
    return "+".join(parts)


if __name__ == "__main__":
    sys.exit(main())
