"""Measured vs predicted on a grid of configurations on this machine (CPU or GPU).

    PYTHONPATH=. .venv/bin/python bench/studies/measure_grid.py                 # 24 single-process configurations
    PYTHONPATH=. .venv/bin/python bench/studies/measure_grid.py --distributed   # + 2-process FSDP / ZeRO configurations
    PYTHONPATH=. .venv/bin/python bench/studies/measure_grid.py --quick         # 4 configurations (smoke)

Two tiny model shapes built here with random weights (no hub): a Llama-style model (multi-head
attention, untied output layer) and a Qwen2-style model (grouped-query attention with 2 KV heads,
q/k/v biases). Every configuration runs in a fresh process (memfit.measure.runner): one warm-up step,
then one profiled step. Prints predicted vs measured allocator-level peak with median and max error (and the
FakeTensorMode traced estimate of the same step beside it),
the per-component errors, then a calibration check: constants fitted on the Llama-style runs only,
errors reported on the Qwen2-style runs (shapes the constants were not fitted to).
Measurements are saved as JSON under --out (input for `memfit calibrate --runs`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


SHAPES = {
    "llama": dict(arch="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4),
    "qwen2": dict(arch="qwen2", hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2),
}
CYCLE = [(256, 4), (512, 2), (1024, 1), (2048, 1), (512, 4), (1024, 2), (256, 1), (2048, 2)]


def build_models(root: Path) -> dict[str, Path]:
    from memfit.measure.worker import synthetic_text_records
    from memfit.train.demo import train_tokenizer

    out = {}
    texts = None
    for name, shape in SHAPES.items():
        folder = root / name
        out[name] = folder
        if (folder / "config.json").is_file():
            continue
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        if texts is None:
            texts = [r["text"] for r in synthetic_text_records(200, 64, seed=5)]
        tok = train_tokenizer(texts, 1024)
        kw = {k: v for k, v in shape.items() if k != "arch"}
        common = dict(vocab_size=len(tok), max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
        torch.manual_seed(0)
        if shape["arch"] == "llama":
            model = LlamaForCausalLM(LlamaConfig(**kw, **common))
        else:
            model = Qwen2ForCausalLM(Qwen2Config(**kw, **common))
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
    return out


def grid(models: dict[str, Path], quick: bool, distributed: bool) -> list[dict]:
    cells = []
    i = 0
    for name in SHAPES:
        for method in ("full", "lora"):
            for gc in (False, True):
                for attn in ("eager", "sdpa"):
                    seq, mb = CYCLE[i % len(CYCLE)]
                    i += 1
                    cells.append(dict(model=name, method=method, gradient_checkpointing=gc, attention=attn,
                                      seq_len=seq, micro_batch_size=mb))
        for seq in (256, 2048):
            for mb in (1, 4):
                cells.append(dict(model=name, method="lora", gradient_checkpointing=seq == 2048,
                                  attention="sdpa", seq_len=seq, micro_batch_size=mb))
    if quick:
        cells = [cells[0], cells[5], cells[12], cells[13]]
    if distributed:
        for name in SHAPES:
            for engine in ({"fsdp": "full_shard"}, {"zero_stage": 2}):
                cells.append(dict(model=name, method="full", gradient_checkpointing=False, attention="sdpa",
                                  seq_len=512, micro_batch_size=2, nproc=2, **engine))
    return cells


def make_run(cell: dict, models: dict[str, Path]):
    from memfit.spec.run import run_from_dict

    strategy = {k: v for k, v in cell.items() if k not in ("model", "nproc")}
    strategy.update(precision="fp32", lora_dropout=0.0)
    return run_from_dict({"model": str(models[cell["model"]]), "hardware": "local", "strategy": strategy,
                          "distributed": {"nproc": cell.get("nproc", 1)}, "output_dir": "/tmp/memfit-bench"})


def fmt_mb(n) -> str:
    return "—" if n is None else f"{n / 1e6:8.2f}"


def fmt_pct(e) -> str:
    return "   —" if e is None else f"{e:+6.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/memfit-measure-grid"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--distributed", action="store_true", help="add 2-process FSDP / ZeRO-2 cells")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per measured process")
    ap.add_argument("--no-trace", action="store_true", help="skip the FakeTensorMode traced estimate")
    ap.add_argument("--retrace", action="store_true", help="with --reuse: trace every configuration again")
    ap.add_argument("--reuse", action="store_true", help="re-predict the measurements saved under --out "
                    "(no new runs): to check an estimator change against the same measurements")
    args = ap.parse_args()

    from memfit.measure.compare import predicted_memory, summarize
    from memfit.measure.runner import measure, save_record

    models = build_models(args.out / "models")
    cells = grid(models, args.quick, args.distributed)
    records = []
    t0 = time.time()
    print(f"{'#':>2} {'model':6} {'method':6} {'engine':16} {'gc':3} {'attn':5} {'seq':>5} {'mb':>2} {'np':>2} "
          f"{'pred MB':>8} {'alloc MB':>8} {'err %':>6} {'trace MB':>8} {'err %':>6} {'RSS MB':>8} {'step s':>7}",
          flush=True)
    for i, cell in enumerate(cells):
        run = make_run(cell, models)
        saved = args.out / "runs" / f"{i:02d}-{cell['model']}.json"
        try:
            if args.reuse:
                if not saved.is_file():
                    continue
                old = json.loads(saved.read_text())
                rec = measure(run, measured=old["measured"])
                if args.retrace and cell.get("nproc", 1) == 1:
                    from memfit.measure.runner import run_traced_process

                    old["traced"] = run_traced_process(run)
                if old.get("traced"):
                    from memfit.measure.compare import error_pct

                    rec["traced"] = old["traced"]
                    rec["error_pct"]["traced_total"] = error_pct(old["traced"]["peak_bytes"],
                                                                 old["measured"]["peak_allocated_bytes"])
            else:
                rec = measure(run, warmup=1, steps=1, threads=args.threads,
                              traced=not args.no_trace and cell.get("nproc", 1) == 1)
        except Exception as err:  # keep going: one failed cell should not lose the grid
            print(f"{i:2d} {cell['model']:6} {run.strategy.label()}: FAILED {err}", flush=True)
            continue
        rec["cell"] = cell
        save_record(rec, args.out / "runs", f"{i:02d}-{cell['model']}")  # --reuse: same measurement, new prediction
        records.append(rec)
        m = rec["measured"]
        pred = predicted_memory(rec["predicted"] or {}).get("total")
        print(f"{i:2d} {cell['model']:6} {cell['method']:6} {run.strategy.engine:16} "
              f"{'on' if cell['gradient_checkpointing'] else 'off':3} "
              f"{cell['attention']:5} {cell['seq_len']:5d} {cell['micro_batch_size']:2d} {cell.get('nproc', 1):2d} "
              f"{fmt_mb(pred)} {fmt_mb(m['peak_allocated_bytes'])} {fmt_pct(rec['error_pct'].get('total'))} "
              f"{fmt_mb((rec.get('traced') or {}).get('peak_bytes'))} {fmt_pct(rec['error_pct'].get('traced_total'))} "
              f"{fmt_mb(m['peak_rss_bytes'])} {m['step_seconds']:7.3f}", flush=True)
    print(f"\n{len(records)} configurations in {time.time() - t0:.0f} s")
    s = summarize([r["error_pct"].get("total") for r in records])
    print(f"allocated peak, |error|: median {s['median_abs_pct']} %, max {s['max_abs_pct']} % (n={s['n']}); "
          "target median <= 5 %, max <= 15 %")
    t = summarize([r["error_pct"].get("traced_total") for r in records])
    if t["n"]:
        print(f"traced step (FakeTensorMode), |error|: median {t['median_abs_pct']} %, max {t['max_abs_pct']} % "
              f"(n={t['n']})")
    print("per component (median error %, signed, over configurations where both sides are non-zero):")
    for comp in ("weights", "gradients", "optimizer", "activations", "logits", "overhead", "step_seconds", "rss"):
        vals = [r["error_pct"].get(comp) for r in records if r["error_pct"].get(comp) is not None]
        if vals:
            print(f"  {comp:12s} median {statistics.median(vals):+7.1f}  min {min(vals):+7.1f}  "
                  f"max {max(vals):+7.1f}  (n={len(vals)})")
    calibration_check(records)
    (args.out / "summary.json").write_text(json.dumps({"summary": s, "traced": t, "n": len(records)}, indent=2))
    return 0


def calibration_check(records: list[dict]) -> None:
    """Fit the constants on the Llama-style runs (logits to the logits, activation constants to the
    total, utilisation to step time), report the Qwen2-style runs' total error with them: shapes the
    constants were not fitted to."""
    try:
        from memfit.estimate.constants import Profile
        from memfit.measure.calibrate import DEFAULT_PLAN, calibrate, run_estimate_fn, total_errors
        from memfit.measure.compare import summarize
    except ImportError:
        return
    train = [r for r in records if r["cell"]["model"] == "llama"]
    held = [r for r in records if r["cell"]["model"] != "llama"]
    if not train or not held:
        return
    fn = run_estimate_fn()
    fitted, reports = calibrate(train, Profile(), fn, plan=[p for p in DEFAULT_PLAN if p[0] != "time"])
    for rep in reports:
        print(f"calibrated on llama runs ({rep['target']}): "
              + ", ".join(f"{k} {rep['before'][k]:.4g} -> {v:.4g}" for k, v in rep["fitted"].items())
              + f" (RMS {rep['rms_error_pct_before']} % -> {rep['rms_error_pct_after']} %)")
    for name, group in (("llama (fitted)", train), ("qwen2 (held out)", held)):
        before = summarize(total_errors(group, Profile(), fn))
        after = summarize(total_errors(group, fitted, fn))
        print(f"{name}: allocated-peak |error| median {before['median_abs_pct']} % -> {after['median_abs_pct']} %, "
              f"max {before['max_abs_pct']} % -> {after['max_abs_pct']} %")


if __name__ == "__main__":
    sys.exit(main())
