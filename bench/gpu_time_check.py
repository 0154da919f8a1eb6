"""GPU check of the hardware calibration and the time model (one short run on a CUDA machine).

    python3 bench/gpu_time_check.py --out DIR          # calibrate (CUDA paths), then 5 training steps x 5 configs
    python3 bench/gpu_time_check.py --smoke            # the same on CPU with tiny sizes (tests the script)

1. ``memfit calibrate --hardware`` on the GPU (torch.cuda.Event timing, pinned copies, GEMM / attention
   / bandwidth / AdamW / dispatch of transformers' layers), saved and printed.
2. A bare training loop (forward, backward, clip, AdamW: what memfit's trainer runs, without the Trainer)
   of a Llama-style model with random weights, per configuration the median of 5 timed steps after 2
   warm-ups (CUDA-synchronised), beside the time model's prediction from the profile just measured. The
   bare loop has no Trainer loop: the prediction's ``trainer_seconds`` is left out of the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def configs(smoke: bool) -> tuple[dict, list[dict]]:
    shape = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=512) if smoke else
             dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000))
    s = 128 if smoke else 1024
    cells = [dict(method="lora", mb=4, seq=s, gc=False, attn="sdpa"),
             dict(method="lora", mb=4, seq=s, gc=True, attn="sdpa"),
             dict(method="full", mb=2, seq=s, gc=False, attn="sdpa"),
             dict(method="lora", mb=2, seq=s, gc=False, attn="eager"),
             dict(method="lora", mb=1, seq=s // 2, gc=False, attn="sdpa")]
    return shape, cells


def bare_step_seconds(shape: dict, c: dict, device: str) -> float:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, max_position_embeddings=4096, attn_implementation=c["attn"])
    model = LlamaForCausalLM(cfg)
    mixed = device == "cuda"
    if c["method"] == "lora":  # memfit's trainer: 16-bit base, fp32 adapters, autocast
        model = model.to(torch.bfloat16 if mixed else torch.float32)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    model = model.to(device)
    if c["gc"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, shape["vocab_size"], (c["mb"], c["seq"]), device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mixed):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    times = []
    for i in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


def predicted(shape: dict, c: dict, hw, device: str) -> dict:
    from memfit.estimate import estimate
    from memfit.spec.model import model_from_config
    from memfit.spec.strategy import Strategy

    spec = model_from_config({"model_type": "llama", **shape}, name="check")
    st = Strategy(method=c["method"], seq_len=c["seq"], micro_batch_size=c["mb"], gradient_checkpointing=c["gc"],
                  attention=c["attn"], precision="bf16-mixed" if device == "cuda" else "fp32", lora_r=16,
                  lora_dropout=0.0)
    return estimate(spec, hw, st).time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/memfit-gpu-time")))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["MEMFIT_CACHE"] = str(args.out / "cache")
    import torch

    from memfit.cli.hardware_cmds import summary_lines
    from memfit.measure.hwcal import ensure_hardware_profile
    from memfit.spec import hwprofile
    from memfit.spec.hardware import parse_hardware

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    t0 = time.time()
    rates, _ = ensure_hardware_profile(force=True, progress=lambda line: print("calibrating", line, flush=True))
    print(f"calibration took {time.time() - t0:.1f} s wall", flush=True)
    path = hwprofile.profile_path(rates.fingerprint)
    print(summary_lines(rates, path, True), flush=True)
    (args.out / "hardware_profile.json").write_text(json.dumps(rates.to_dict(), indent=1))
    hw = parse_hardware("local")
    print(f"pool: {hw.describe()}, rates attached: {hw.rates is not None}")
    shape, cells = configs(args.smoke)
    rows = []
    print(f"{'config':32s} {'pred ms':>8s} {'bare ms':>8s} {'err %':>6s}  parts (ms)")
    for c in cells:
        t = predicted(shape, c, hw, device)
        pred = (t["step_seconds"] - t["trainer_seconds"]) * 1e3
        meas = bare_step_seconds(shape, c, device) * 1e3
        name = f"{c['method']} mb{c['mb']} s{c['seq']} {'gc' if c['gc'] else '--'} {c['attn']}"
        parts = {k.removesuffix("_seconds"): round(t[k] * 1e3, 2) for k in
                 ("matmul_seconds", "attention_seconds", "memory_bound_seconds", "dispatch_seconds",
                  "optimizer_seconds")}
        rows.append({"config": c, "predicted_ms": pred, "measured_ms": meas, "parts_ms": parts, "basis": t["basis"]})
        print(f"{name:32s} {pred:8.1f} {meas:8.1f} {100 * (pred / meas - 1):+6.1f}  {parts}", flush=True)
    errs = [abs(r["predicted_ms"] / r["measured_ms"] - 1) * 100 for r in rows]
    print(f"|error| median {statistics.median(errs):.1f} %, max {max(errs):.1f} % (n={len(rows)}); "
          f"basis: {rows[0]['basis']}")
    (args.out / "gpu_time_check.json").write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
