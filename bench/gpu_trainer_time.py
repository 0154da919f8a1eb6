"""memfit's own trainer on one GPU: its measured step against the prediction of the same run, calibrated.

    PYTHONPATH=. python3 bench/gpu_trainer_time.py --out DIR     # on a CUDA machine: calibrate, then 4 runs (~2-3 min)
    PYTHONPATH=. python3 bench/gpu_trainer_time.py --smoke       # the same path on a CPU with a tiny model

Where bench/gpu_time_check.py times a bare loop, this runs what a user runs: ``memfit measure``'s path
(memfit.measure.runner.run_measured_process: a fresh process, memfit's Trainer, 1 warm-up + 1 profiled +
5 timed steps, the median) beside ``runner.predict`` of the same run (the whole step: micro-batches,
optimizer, the Trainer's own loop), with the hardware profile measured at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=16)
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)


def cells(smoke: bool) -> list[dict]:
    s = 128 if smoke else 1024
    return [dict(method="lora", micro_batch_size=4, seq_len=s), dict(method="lora", micro_batch_size=4, seq_len=s,
                                                                       gradient_checkpointing=True),
            dict(method="full", micro_batch_size=2, seq_len=s), dict(method="qlora", micro_batch_size=4, seq_len=s)]


def build_model(folder: Path, shape: dict) -> Path:
    """A Llama-style folder with random weights and a tokenizer trained here (no hub)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.measure.worker import synthetic_text_records
    from memfit.train.demo import train_tokenizer

    tok = train_tokenizer([r["text"] for r in synthetic_text_records(200, 64, seed=5)], 2048)
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, vocab_size=len(tok), max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def make_run(cell: dict, model: Path, cuda: bool):
    from memfit.spec.run import run_from_dict

    strategy = {**cell, "precision": "bf16-mixed" if cuda else "fp32", "lora_dropout": 0.0}
    return run_from_dict({"model": str(model), "hardware": "local", "strategy": strategy,
                          "output_dir": "/tmp/memfit-gpu-trainer-time"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/memfit-gpu-trainer-time")))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["MEMFIT_CACHE"] = str(args.out / "cache")  # the measured processes see the same profile
    import tempfile

    import torch

    from memfit.errors import MemfitError
    from memfit.measure.hwcal import ensure_hardware_profile
    from memfit.measure.runner import predict, run_measured_process

    cuda = torch.cuda.is_available() and not args.smoke
    t0 = time.time()
    rates, _ = ensure_hardware_profile(force=True)
    print(f"calibrated in {time.time() - t0:.1f} s ({rates.basis})", flush=True)
    model = build_model(Path(tempfile.mkdtemp(prefix="memfit-gpu-trainer-")) / "model", TINY if args.smoke else SHAPE)
    rows = []
    print(f"{'run':36s} {'pred ms':>8s} {'trainer':>8s} {'meas ms':>8s} {'err %':>6s}", flush=True)
    for cell in cells(args.smoke):
        run = make_run(cell, model, cuda)
        t = predict(run)["time"]
        name = " ".join(f"{k}={v}" for k, v in cell.items())
        try:
            m = run_measured_process(run, warmup=1, steps=5, categories=False)
        except MemfitError as err:
            rows.append({"cell": cell, "error": str(err)[:300]})
            print(f"{name:36s} failed: {str(err).splitlines()[0][:120]}", flush=True)
            continue
        pred, meas = t["step_seconds"] * 1e3, m["step_seconds"] * 1e3
        rows.append({"cell": cell, "predicted_ms": pred, "trainer_ms": t["trainer_seconds"] * 1e3, "measured_ms": meas,
                     "steps_ms": [s * 1e3 for s in (m.get("ranks") or [{}])[0].get("step_seconds_all", [])],
                     "basis": t["basis"]})
        print(f"{name:36s} {pred:8.1f} {t['trainer_seconds'] * 1e3:8.1f} {meas:8.1f} {100 * (pred / meas - 1):+6.1f}",
              flush=True)
        (args.out / "gpu_trainer_time.json").write_text(json.dumps({"profile": rates.to_dict(), "rows": rows},
                                                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
