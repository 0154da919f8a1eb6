"""GPU check of the hardware calibration and the time model (one short run on a CUDA machine).

    PYTHONPATH=. python3 bench/gpu_time_check.py --out DIR  # calibrate (CUDA paths), then 5 training steps x 10 configs
    PYTHONPATH=. python3 bench/gpu_time_check.py --smoke      # the same on CPU with tiny sizes (tests the script)
    PYTHONPATH=. python3 bench/gpu_time_check.py --replay FILE  # re-predict a saved run with today's time model

1. ``memfit calibrate --hardware`` on the GPU (torch.cuda.Event timing, pinned copies, GEMM / attention
   / bandwidth / AdamW / dispatch of transformers' layers), saved and printed.
2. A bare training loop (forward, backward, clip, AdamW: what memfit's trainer runs, without the Trainer)
   of a Llama-style model with random weights, per configuration the median of 5 timed steps after 2
   warm-ups (CUDA-synchronised; the Trainer's loss check after backward kept: a host sync), in two
   passes (the second in reverse order, the lower median kept), beside the time model's prediction from the profile just
   measured. The bare loop has no Trainer loop: the prediction's ``trainer_seconds`` is left out of the comparison.
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
             dict(method="full", mb=4, seq=s, gc=True, attn="sdpa"),
             dict(method="lora", mb=8, seq=s, gc=False, attn="sdpa"),
             dict(method="lora", mb=4, seq=s, gc=True, attn="eager"),
             dict(method="qlora", mb=4, seq=s, gc=False, attn="sdpa"),
             dict(method="qlora", mb=4, seq=s, gc=True, attn="sdpa"),
             dict(method="lora", mb=1, seq=s // 2, gc=False, attn="sdpa")]
    # host probes: 16 tokens, so the device's work is nil and the step is the host's dispatch alone (the
    # calibration measures it on a width-16 model; these read it at the real width)
    probes = [dict(method=m, mb=1, seq=16, gc=gc, attn=a) for m, gc, a in
              (("lora", False, "sdpa"), ("lora", False, "eager"), ("lora", True, "sdpa"), ("full", False, "sdpa"),
               ("qlora", False, "sdpa"))]
    return shape, probes + cells


def build_model(shape: dict, c: dict, device: str, tmp: Path):
    """The model as memfit's methods build it: LoRA on a 16-bit base (fp32 adapters), QLoRA through
    transformers' BitsAndBytesConfig (NF4, double quantisation) + prepare_model_for_kbit_training."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    mixed = device == "cuda"
    cfg = LlamaConfig(**shape, max_position_embeddings=4096, attn_implementation=c["attn"])
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    if c["method"] == "qlora":
        folder = tmp / "qlora-base"
        if not folder.is_dir():
            LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16 if mixed else torch.float32)
        model = LlamaForCausalLM.from_pretrained(folder, quantization_config=q, dtype=torch.bfloat16,
                                                 device_map={"": device}, attn_implementation=c["attn"])
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=c["gc"],
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
        return get_peft_model(model, lora)
    model = LlamaForCausalLM(cfg)
    if c["method"] == "lora":  # memfit's trainer: 16-bit base, fp32 adapters, autocast
        model = get_peft_model(model.to(torch.bfloat16 if mixed else torch.float32), lora)
    model = model.to(device)
    if c["gc"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    return model


def bare_step_seconds(shape: dict, c: dict, device: str, tmp: Path) -> float:
    import torch

    mixed = device == "cuda"
    model = build_model(shape, c, device, tmp)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, shape["vocab_size"], (c["mb"], c["seq"]), device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mixed):
            # F821 on model/opt: ruff sees the `del model, opt` after the timing loop; step() only runs before it
            loss = model(input_ids=ids, labels=ids).loss  # noqa: F821
        loss.backward()
        if torch.isnan(loss.detach()):  # the HF Trainer's loss check after each micro-batch: a host sync
            raise FloatingPointError("loss is nan")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()  # noqa: F821
        opt.zero_grad(set_to_none=True)  # noqa: F821
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


def name_of(c: dict) -> str:
    return f"{c['method']} mb{c['mb']} s{c['seq']} {'gc' if c['gc'] else '--'} {c['attn']}"


def report(rows: list[dict], shape: dict, hw, device: str) -> list[str]:
    """The table: the bare loop against the time model on ``hw`` (its basis named), |error| and the Kendall
    tau of the configurations that share the sequence length (the model is one shape)."""
    from bench.time_grid import kendall_tau

    lines = [f"{'config':28s} {'pred ms':>8s} {'bare ms':>8s} {'err %':>6s}  parts (ms)"]
    done = [r for r in rows if r.get("measured_ms")]
    for r in rows:
        if not r.get("measured_ms"):
            lines.append(f"{name_of(r['config']):28s} not measured: {r.get('error', '?')}")
            continue
        t = predicted(shape, r["config"], hw, device)
        r["predicted_ms"] = pred = (t["step_seconds"] - t["trainer_seconds"]) * 1e3
        r["parts_ms"] = {k.removesuffix("_seconds"): round(t[k] * 1e3, 2) for k in
                         ("matmul_seconds", "attention_seconds", "memory_bound_seconds", "dispatch_seconds",
                          "optimizer_seconds")}
        r["basis"] = t["basis"]
        lines.append(f"{name_of(r['config']):28s} {pred:8.1f} {r['measured_ms']:8.1f} "
                     f"{100 * (pred / r['measured_ms'] - 1):+6.1f}  {r['parts_ms']}")
    if done:
        errs = [abs(r["predicted_ms"] / r["measured_ms"] - 1) * 100 for r in done]
        lines.append(f"|error| median {statistics.median(errs):.1f} %, max {max(errs):.1f} % (n={len(done)}); "
                     f"basis: {done[0]['basis']}")
        for seq in sorted({r["config"]["seq"] for r in done}):
            group = [r for r in done if r["config"]["seq"] == seq]
            if len(group) > 2:
                tau = kendall_tau([r["predicted_ms"] for r in group], [r["measured_ms"] for r in group])
                lines.append(f"Kendall tau, seq {seq} ({len(group)} configurations): {tau:.2f}")
    return lines


def replay(path: Path) -> int:
    """Re-predict saved measurements with today's time model: on the profile measured then, and on the
    catalog (uncalibrated)."""
    from memfit.spec import hwprofile
    from memfit.spec.hardware import parse_hardware

    raw = json.loads(path.read_text())
    rates = hwprofile.HardwareRates.from_dict(raw["profile"])
    hw = parse_hardware(raw["catalog_pool"])
    for basis, pool in (("calibrated", _with_rates(hw, rates)), ("catalog", hw)):
        print(f"-- {basis}")
        print("\n".join(report(raw["rows"], raw["shape"], pool, raw["device"])))
    return 0


def _with_rates(hw, rates):
    from dataclasses import replace

    return replace(hw, rates=rates, label="local")


def measure_all(shape: dict, cells: list[dict], device: str, out: Path, record: dict) -> None:
    """Each configuration's bare-loop median step; a failure is kept as its error line (the rest go on)."""
    import tempfile
    import traceback

    tmp = Path(tempfile.mkdtemp(prefix="memfit-gpu-time-"))  # the QLoRA base folder: not among the results
    record["rows"] = rows = [{"config": c, "passes_ms": []} for c in cells]
    for order in (rows, rows[::-1]):  # two passes, the second in reverse order; the lower median is kept
        for row in order:
            if "error" in row:
                continue
            try:
                row["passes_ms"].append(bare_step_seconds(shape, row["config"], device, tmp) * 1e3)
                row["measured_ms"] = min(row["passes_ms"])
            except Exception as exc:  # noqa: BLE001 -- one GPU run: keep going, say what failed
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            print(f"measured {name_of(row['config'])}: {row.get('passes_ms')} {row.get('error', '')}", flush=True)
            (out / "gpu_time_check.json").write_text(json.dumps(record, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/memfit-gpu-time")))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--replay", type=Path, help="a saved gpu_time_check.json: re-predict it (no GPU needed)")
    args = ap.parse_args()
    if args.replay:
        return replay(args.replay)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["MEMFIT_CACHE"] = str(args.out / "cache")
    import torch

    from memfit.cli.hardware_cmds import summary_lines
    from memfit.measure.hwcal import ensure_hardware_profile
    from memfit.spec import hwprofile
    from memfit.spec.hardware import parse_hardware

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    versions = {m: __import__(m).__version__ for m in ("torch", "transformers", "peft")}
    print(f"device {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}; {versions}", flush=True)
    t0 = time.time()
    rates, _ = ensure_hardware_profile(force=True, progress=lambda line: print("calibrating", line, flush=True))
    print(f"calibration took {time.time() - t0:.1f} s wall", flush=True)
    print(summary_lines(rates, hwprofile.profile_path(rates.fingerprint), True), flush=True)
    hw = parse_hardware("local")
    catalog_pool = "1xH200-141GB" if device == "cuda" else "local"
    print(f"pool: {hw.describe()}, rates attached: {hw.rates is not None}", flush=True)
    shape, cells = configs(args.smoke)
    record = {"device": device, "versions": versions, "shape": shape, "catalog_pool": catalog_pool,
              "profile": rates.to_dict(), "rows": []}
    measure_all(shape, cells, device, args.out, record)
    print("\n".join(report(record["rows"], shape, hw, device)))
    if device == "cuda":
        print("-- the same rows on the catalog H200 (uncalibrated)")
        print("\n".join(report(record["rows"], shape, parse_hardware(catalog_pool), device)))
    (args.out / "gpu_time_check.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
