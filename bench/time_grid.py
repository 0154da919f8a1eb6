"""Predicted vs measured step time on a grid of configurations on this machine.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/time_grid.py          # calibrate, measure + predict (~11 min)
    PYTHONPATH=. .venv/bin/python bench/time_grid.py --reuse                    # re-predict the saved measurements
    PYTHONPATH=. .venv/bin/python bench/time_grid.py --quick                    # 6 configurations (smoke)
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/time_grid.py --held-out
        # 8 drawn outside it (time_grid_heldout.py)

Two model shapes built here with random weights (a Llama-style h 256 / 4 layers and a Qwen2-style
h 128 / 4 layers with grouped-query attention and q/k/v biases); full / LoRA / QLoRA, checkpointing on
and off, eager / SDPA, micro-batch 1-8, sequence 128-1024, 1 and 2 processes (DDP, ZeRO-2, FSDP). Every
configuration runs in a fresh process through memfit's trainer (memfit.measure.runner): 1 warm-up step,
1 profiled step (not timed), then the timed steps; the measured figure is the median timed step (wall
and process CPU time; with several ranks the slowest rank's). Every process runs one thread
(OMP_NUM_THREADS=1 is set here), so on a quiet machine wall ≈ CPU time; on a loaded one the CPU time is
the steadier figure.

The grid is measured group by group (the configurations sharing a model and a sequence length, the ones
ranked against each other), each group inside its own calibration window: calibrate
(`memfit calibrate --hardware`, in a cache folder of its own), measure the group's configurations
step-interleaved (memfit.measure.baton: all of them alive at once, each in its own process, one training step
at a time in turn, so every configuration meets the same moments of a machine whose speed drifts by ±20-30 %
within seconds; ``--sequential``: one configuration after another, as before), measure them again (in reverse
order; the lower median of the two passes is kept, since a neighbour on a shared machine only ever slows a
step; ``--passes 3`` adds a third), calibrate again. The report predicts every configuration with the median
of all the run's calibrations (``profile.json``: two per group, spread through the run; the rule memfit's own
profile follows), and prints the figures again with each group's own two calibrations
(``profile-<model>-<seq>.json``).

Prints per configuration the predicted and measured step, the error, and per group of configurations
sharing a model and a sequence length the Kendall rank correlation of predicted vs measured order.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.grid_profile import use_saved_profile, window_profile  # noqa: F401 - time_grid.window_profile is used by the held-out grid

HERE = Path(__file__).resolve().parent


def _measuring_environment() -> None:
    """Set (in main only) one thread per process and glibc's settled state for the measured processes (else
    memfit measure's 64 KiB threshold: every freed tensor over 64 kB re-faults), mmap threshold at its 32 MiB
    ceiling and trim at twice it; the first alone leaves trim at 128 KiB, re-faulting the heap (docs/time.md)."""
    from memfit.steptime.cpu import GLIBC_MMAP_THRESHOLD_MAX, GLIBC_SETTLED_TRIM_THRESHOLD

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(GLIBC_MMAP_THRESHOLD_MAX))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(GLIBC_SETTLED_TRIM_THRESHOLD))

SHAPES = {
    "llama": dict(arch="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8),
    "qwen2": dict(arch="qwen2", hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2),
}


def _c(model, seq, mb, method="lora", gc=False, attn="sdpa", nproc=1, **engine):
    return dict(model=model, seq_len=seq, micro_batch_size=mb, method=method, gradient_checkpointing=gc,
                attention=attn, nproc=nproc, **engine)


CELLS = [
    # llama, seq 256
    _c("llama", 256, 2, "full"), _c("llama", 256, 2), _c("llama", 256, 2, gc=True), _c("llama", 256, 4, attn="eager"),
    _c("llama", 256, 2, "qlora"), _c("llama", 256, 2, "full", nproc=2),
    _c("llama", 256, 2, "full", nproc=2, zero_stage=2), _c("llama", 256, 2, "full", nproc=2, fsdp="full_shard"),
    # llama, seq 1024
    _c("llama", 1024, 1), _c("llama", 1024, 1, gc=True, attn="eager"), _c("llama", 1024, 1, "full", gc=True),
    _c("llama", 1024, 2),
    # qwen2, seq 128
    _c("qwen2", 128, 8, "full"), _c("qwen2", 128, 8), _c("qwen2", 128, 1, attn="eager"),
    _c("qwen2", 128, 4, "full", gc=True, attn="eager"),
    # qwen2, seq 512
    _c("qwen2", 512, 2, "full"), _c("qwen2", 512, 4, gc=True), _c("qwen2", 512, 2, "qlora"),
    _c("qwen2", 512, 2, nproc=2),
]
QUICK = [0, 1, 2, 12, 13, 14]


def build_models(root: Path) -> dict[str, Path]:
    out = {}
    for name, shape in SHAPES.items():
        folder = root / name
        out[name] = folder
        if (folder / "config.json").is_file():
            continue
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        from memfit.measure.worker import synthetic_text_records
        from memfit.train.demo import train_tokenizer

        tok = train_tokenizer([r["text"] for r in synthetic_text_records(200, 64, seed=5)], 2048)
        kw = {k: v for k, v in shape.items() if k != "arch"}
        common = dict(vocab_size=len(tok), max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
        torch.manual_seed(0)
        cls, cfg = (LlamaForCausalLM, LlamaConfig) if shape["arch"] == "llama" else (Qwen2ForCausalLM, Qwen2Config)
        cls(cfg(**kw, **common)).save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
    return out


def text_data(path: Path, rows: int, seq_len: int) -> Path:
    """A JSONL of ``rows`` synthetic text records of at least ``seq_len`` tokens (the benches' training data)."""
    from memfit.measure.worker import synthetic_text_records

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_text_records(rows, seq_len, seed=1)))
    return path


def make_run(cell: dict, models: dict[str, Path]):
    from memfit.spec.run import run_from_dict

    strategy = {k: v for k, v in cell.items() if k not in ("model", "nproc")}
    strategy.update(precision="fp32", lora_dropout=0.0)
    return run_from_dict({"model": str(models[cell["model"]]), "hardware": "local", "strategy": strategy,
                          "distributed": {"nproc": cell["nproc"]}, "output_dir": "/tmp/memfit-time-grid"})


def label(cell: dict) -> str:
    eng = "fsdp" if cell.get("fsdp") else f"zero{cell['zero_stage']}" if cell.get("zero_stage") else "ddp"
    return (f"{cell['model']:5s} {cell['method']:5s} {eng:5s} {'gc' if cell['gradient_checkpointing'] else '--'} "
            f"{cell['attention']:5s} {cell['seq_len']:5d} {cell['micro_batch_size']:2d} {cell['nproc']}")


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-a over all pairs (ties count as neither)."""
    n, s = len(xs), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 else -1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 else 0)
    pairs = n * (n - 1) // 2
    return s / pairs if pairs else float("nan")


def predict_ms(cell: dict, models: dict[str, Path]) -> tuple[float, str]:
    from memfit.measure.runner import predict

    d = predict(make_run(cell, models))
    return d["time"]["step_seconds"] * 1e3, d["time"]["basis"]


def _save(out: Path, i: int, cell: dict, measured: dict, at: str, **extra) -> None:
    """One configuration's record, ``cell<index>.json``: what was run, measured, the load and when."""
    rec = {"cell": cell, "measured": measured, "load": os.getloadavg(), "at": at, **extra}
    (out / f"cell{i:02d}.json").write_text(json.dumps(rec, indent=1))


def measure_cells(cells: list[tuple[int, dict]], models: dict[str, Path], out: Path, steps: int) -> None:
    """Measure ``(grid index, configuration)`` pairs in this order, each record saved as ``cell<index>.json``."""
    from memfit.errors import MemfitError
    from memfit.measure.runner import run_measured_process

    out.mkdir(parents=True, exist_ok=True)
    for n, (i, cell) in enumerate(cells):
        t0 = time.time()
        try:
            m = run_measured_process(make_run(cell, models), warmup=1, steps=steps, categories=False, threads=1)
        except MemfitError as err:
            m = {"error": str(err)[:300]}
        _save(out, i, cell, m, time.strftime("%H:%M:%S"))
        print(f"  measured {n + 1}/{len(cells)} #{i} {label(cell)}  {time.time() - t0:.0f} s  "
              f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)


def measure_interleaved(cells: list[tuple[int, dict]], models: dict[str, Path], out: Path, steps: int) -> None:
    """Measure ``(grid index, configuration)`` pairs all at once, step-interleaved (memfit.measure.baton):
    every configuration in its own fresh process through memfit's trainer, one step at a time in turn, so
    each meets the same moments of the machine; saved as ``cell<index>.json`` like :func:`measure_cells`."""
    import shutil
    import tempfile
    import threading

    from memfit.errors import MemfitError
    from memfit.measure.baton import Coordinator
    from memfit.measure.runner import run_measured_process

    out.mkdir(parents=True, exist_ok=True)
    coordinator, results, threads = Coordinator(Path(tempfile.mkdtemp(prefix="memfit-baton-"))), {}, {}
    t0, at = time.time(), time.strftime("%H:%M:%S")

    def one(i: int, cell: dict, gate: dict) -> None:
        try:
            results[i] = run_measured_process(make_run(cell, models), warmup=1, steps=steps, categories=False,
                                              threads=1, baton=gate)
        except MemfitError as err:
            results[i] = {"error": str(err)[:300]}
    gates = {i: coordinator.gate_spec(f"cell{i}") for i, _ in cells}
    for i, cell in cells:
        threads[i] = threading.Thread(target=one, args=(i, cell, gates[i]), daemon=True)
        threads[i].start()
    coordinator.run([f"cell{i}" for i, _ in cells], lambda name: threads[int(name[4:])].is_alive())
    for t in threads.values():
        t.join()
    coordinator.close()
    shutil.rmtree(coordinator.folder, ignore_errors=True)  # its named pipes
    for i, cell in cells:
        _save(out, i, cell, results.get(i, {"error": "no result"}), at, interleaved=[j for j, _ in cells])
    print(f"  measured {len(cells)} configurations step-interleaved  {time.time() - t0:.0f} s  "
          f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)


def group_key(cell: dict) -> str:
    return f"{cell['model']}-{cell['seq_len']}"


def groups_of(cells: list[dict], only: list[int] | None = None) -> dict[str, list[int]]:
    """{group key: grid indices}, in grid order (``only``: just those indices)."""
    out: dict[str, list[int]] = {}
    for i, cell in enumerate(cells):
        if only is None or i in only:
            out.setdefault(group_key(cell), []).append(i)
    return out


def _calibrate(what: str):
    from memfit.measure.hwcal import ensure_hardware_profile

    rates, _ = ensure_hardware_profile(force=True, progress=lambda line: print(f"  calibrating ({what}) {line}",
                                                                                file=sys.stderr))
    print(f"  calibration ({what}) took {rates.took_seconds:.1f} s", file=sys.stderr)
    return rates


def measure_group(key: str, idx: list[int], cells: list[dict], models: dict[str, Path], out: Path,
                  steps: int, passes: int, interleave: bool = True) -> None:
    """One group in its own calibration window: calibrate, measure (step-interleaved, or one configuration
    after another), measure again (in reverse order), calibrate; the group's profile (the median of its two
    calibrations) saved as ``profile-<key>.json``."""
    import shutil

    cache = out / "cache" / key
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["MEMFIT_CACHE"] = str(cache)  # this window's calibrations only
    _calibrate(f"{key}, before")
    measure = measure_interleaved if interleave else measure_cells
    measure([(i, cells[i]) for i in idx], models, out, steps)
    for k in range(2, passes + 1):  # again, every other pass in reverse order: a drift meets both ends
        order = reversed(idx) if k % 2 == 0 else idx
        measure([(i, cells[i]) for i in order], models, out / f"pass{k}", steps)
    rates = _calibrate(f"{key}, after")
    (out / f"profile-{key}.json").write_text(json.dumps(rates.to_dict(), indent=1))


def _measured(rec: dict, again: list[dict]) -> tuple[float, float, float]:
    """(wall ms, CPU ms, spread %): the lowest of the passes' medians (a neighbour on a shared machine only
    ever slows a step), and how far apart the passes were."""
    ms = [rec["measured"]] + [a["measured"] for a in again if "error" not in a["measured"]]
    walls = [m["step_seconds"] * 1e3 for m in ms]
    cpus = [(m.get("step_cpu_seconds") or 0) * 1e3 for m in ms]
    return min(walls), min(cpus), 100 * (max(walls) / min(walls) - 1)


def profile_for(out: Path, cell: dict) -> Path | None:
    """The profile a configuration is predicted with: its group's window, else the run's one profile."""
    for path in (out / f"profile-{group_key(cell)}.json", out / "profile.json"):
        if path.is_file():
            return path
    return None


def summarise(rows: list[tuple], title: str) -> None:
    """Median / max |error| and Kendall tau per group, against wall and CPU time."""
    for name, col, err in (("wall", 2, 4), ("CPU time", 3, 5)):
        errs = [abs(r[err]) for r in rows]
        print(f"{title}|error| vs {name}: median {statistics.median(errs):.1f} %, max {max(errs):.1f} % "
              f"(n={len(errs)}); target median <= 15 %, max <= 35 %")
        groups: dict[tuple, list] = {}
        for r in rows:
            groups.setdefault((r[0]["model"], r[0]["seq_len"]), []).append(r)
        taus = {k: kendall_tau([r[1] for r in g], [r[col] for r in g]) for k, g in groups.items() if len(g) > 1}
        print(f"{title}Kendall tau vs {name} per group (model, seq): "
              + ", ".join(f"{k[0]} {k[1]}: {t:+.2f} (n={len(groups[k])})" for k, t in taus.items())
              + "; target >= 0.8")
        if col == 2:  # the pairs out of order, and how far apart they were measured
            out_of_order = [f"#{CELLS.index(a[0])}/#{CELLS.index(b[0])} {100 * abs(a[2] / b[2] - 1):.1f} %"
                            for g in groups.values() for i, a in enumerate(g) for b in g[i + 1:]
                            if (a[1] - b[1]) * (a[2] - b[2]) < 0]
            print(f"{title}pairs out of order (measured apart): " + (", ".join(out_of_order) or "none"))


def predicted_rows(recs: list[tuple[int, dict]], second: list[dict], models: dict[str, Path], out: Path,
                   fixed: Path | None = None, show: bool = False, saved: bool = True) -> tuple[list[tuple], str]:
    """(cell, pred, wall, cpu, wall err %, cpu err %) per measured configuration; each predicted with its
    group's profile, or with ``fixed`` for every row (``saved=False``: with this machine's cached profile)."""
    rows, basis, current = [], "", None
    for i, r in recs:
        cell, m = r["cell"], r["measured"]
        if "error" in m:
            if show:
                print(f"{i:2d} {label(cell)}   failed: {m['error'][:80]}")
            continue
        path = (fixed or profile_for(out, cell)) if saved else None
        if path is not None and path != current:
            use_saved_profile(path, quiet=not show)
            current = path
        pred, basis = predict_ms(cell, models)
        again = [p[f"cell{i:02d}.json"] for p in second if f"cell{i:02d}.json" in p]
        wall, cpu, apart = _measured(r, again)
        ew, ec = 100 * (pred / wall - 1), (100 * (pred / cpu - 1) if cpu else float("nan"))
        rows.append((cell, pred, wall, cpu, ew, ec))
        if show:
            apart_txt = f"  {apart:5.1f} %" if again else ""
            print(f"{i:2d} {label(cell)} {pred:9.1f} {wall:9.1f} {ew:+6.1f} {cpu:9.1f} {ec:+6.1f}  "
                  f"{r['load'][0]:.1f}  {r.get('at', ''):8s}" + apart_txt)
    return rows, basis


def report(out: Path, models: dict[str, Path], current_profile: bool = False) -> int:
    recs = [(int(p.stem[4:]), json.loads(p.read_text())) for p in sorted(out.glob("cell*.json"))]
    second = [{p.name: json.loads(p.read_text()) for p in d.glob("cell*.json")}
              for d in sorted(out.glob("pass[0-9]*"))]
    print(" # model method eng   gc attn    seq mb np   pred ms   wall ms  err %    cpu ms  err %  load  at"
          "       passes apart")
    window = out / "profile.json"
    rows, basis = predicted_rows(recs, second, models, out, fixed=window if window.is_file() else None,
                                 show=True, saved=not current_profile)
    if not rows:
        return 1
    print(f"\nbasis: {basis}" + ("" if current_profile else f" ({window.name} of the run)"))
    summarise(rows, "")
    if not current_profile and any(out.glob("profile-*.json")):
        by_group, _ = predicted_rows(recs, second, models, out)
        print("\neach group predicted with its own two calibrations (profile-<model>-<seq>.json):")
        summarise(by_group, "  ")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default /tmp/memfit-time-grid[-held-out]")
    ap.add_argument("--models", type=Path, default=Path("/tmp/memfit-time-grid-models"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="re-predict the measurements saved under --out")
    ap.add_argument("--steps", type=int, default=6, help="steps after the warm-up (the first is profiled)")
    ap.add_argument("--passes", type=int, default=2, choices=(1, 2, 3),
                    help="measure every configuration this many times (every other pass in reverse order; the lowest "
                         "median is kept)")
    ap.add_argument("--sequential", action="store_true",
                    help="measure a group's configurations one after another, not step-interleaved")
    ap.add_argument("--current-profile", action="store_true",
                    help="with --reuse: predict with this machine's cached profile, not the ones saved with the run")
    ap.add_argument("--only", type=str, default=None,
                    help="comma-separated configuration numbers to (re)measure, in new windows of their groups")
    ap.add_argument("--held-out", action="store_true",
                    help="configurations drawn outside this grid (time_grid_heldout.py)")
    ap.add_argument("--n", type=int, default=8, help="with --held-out: how many")
    ap.add_argument("--seed", type=int, default=0, help="with --held-out: the draw's seed")
    args = ap.parse_args()
    args.out = args.out or Path("/tmp/memfit-time-grid" + ("-held-out" if args.held_out else ""))
    _measuring_environment()
    if args.held_out:  # SHAPES and CELLS become the drawn ones, their models built; a header names them
        from bench import time_grid_heldout

        time_grid_heldout.use(sys.modules[__name__], args.n, args.seed, args.models)
    models = build_models(args.models)
    cells = [CELLS[i] for i in QUICK] if args.quick else CELLS
    if not args.reuse:
        args.out.mkdir(parents=True, exist_ok=True)
        only = [int(x) for x in args.only.split(",")] if args.only else None
        t0, user_cache = time.time(), os.environ.get("MEMFIT_CACHE")
        print(f"load before: {os.getloadavg()}", file=sys.stderr)
        for key, idx in groups_of(cells, only).items():
            measure_group(key, idx, cells, models, args.out, args.steps, args.passes, not args.sequential)
        window_profile(args.out)
        if user_cache is None:
            os.environ.pop("MEMFIT_CACHE", None)
        else:
            os.environ["MEMFIT_CACHE"] = user_cache
        print(f"measured in {time.time() - t0:.0f} s; load after: {os.getloadavg()}", file=sys.stderr)
    return report(args.out, models, current_profile=args.current_profile)


if __name__ == "__main__":
    sys.exit(main())
