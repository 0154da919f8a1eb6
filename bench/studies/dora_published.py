"""DoRA's estimate against the four published DoRA rows and their LoRA twins.

    PYTHONPATH=. .venv/bin/python bench/studies/dora_published.py [--model llama-3.2-3b] \\
        [--rows ../shared/reference/gpu-runs/public.jsonl]

The rows: PEFT's MetaMathQA method comparison (huggingface/peft method_comparison/MetaMathQA/results),
Llama-3.2-3B on 1x L40S, pure bf16 base with fp32 adapters, batch 4 x <= 768 tokens, AdamW, no
checkpointing, LoRA r=32 on q_proj + v_proj with and without use_dora. Printed: the trainable parameters,
the estimate's per-GPU total against each DoRA row's measured peak (torch max_memory_reserved), and the
DoRA-minus-LoRA difference (mean of the rows) against the estimate's difference. Plain Python, no GPU.
"""
import argparse
import json
from pathlib import Path

from memfit.estimate import estimate
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="llama-3.2-3b", help="preset, folder or config.json of Llama-3.2-3B")
ap.add_argument("--rows", default=str(Path(__file__).resolve().parents[3] / "shared/reference/gpu-runs/public.jsonl"))
args = ap.parse_args()
model = resolve_model(args.model)
rows = [json.loads(line) for line in open(args.rows)]


def pick(dora):
    out = []
    for r in rows:
        pc = r.get("peft_config") or {}
        if (r.get("source_group") == "peft-mmqa" and pc.get("peft_type") == "LORA" and pc.get("r") == 32
                and sorted(pc.get("target_modules") or []) == ["q_proj", "v_proj"] and not pc.get("use_rslora")
                and bool(pc.get("use_dora")) == dora
                and r["experiment_name"].endswith("rank32" + ("-dora" if dora else ""))):
            out.append(r)
    return out


hw = parse_hardware("1xL40S-48GB")
keys = dict(precision="bf16", micro_batch_size=4, seq_len=768, lora_r=32, lora_alpha=64, lora_dropout=0.0,
            lora_targets=("q_proj", "v_proj"), attention="sdpa", optimizer="adamw")
est = {m: estimate(model, hw, Strategy(method=m, **keys)).to_dict() for m in ("lora", "dora")}
for m in ("lora", "dora"):
    mem = est[m]["memory"]
    print(f"{m}: trainable {est[m]['model']['trainable_parameters']}, predicted allocated "
          f"{mem['gpu_bytes']['total'] / 1e9:.3f} GB (lora_intermediates "
          f"{mem['gpu_bytes']['lora_intermediates'] / 1e9:.3f} GB)")
lora_rows, dora_rows = pick(False), pick(True)
print("rows:", [r["id"] for r in dora_rows])
lora_peak = sum(r["primary_memory"]["value"] for r in lora_rows) / len(lora_rows)
for r in dora_rows:
    meas = r["primary_memory"]["value"]
    pred = est["dora"]["memory"]["gpu_bytes"]["total"]
    print(f"{r['id']}: trainable {r.get('trainable_params')}, measured peak reserved {meas / 1e9:.3f} GB, "
          f"predicted {pred / 1e9:.3f} GB, error {100 * (pred - meas) / meas:+.1f}%")
d_meas = sum(r["primary_memory"]["value"] for r in dora_rows) / len(dora_rows) - lora_peak
d_pred = est["dora"]["memory"]["gpu_bytes"]["total"] - est["lora"]["memory"]["gpu_bytes"]["total"]
print(f"DoRA - LoRA (mean of the {len(dora_rows)} DoRA and {len(lora_rows)} LoRA rows): measured "
      f"{d_meas / 1e9:.3f} GB, predicted {d_pred / 1e9:.3f} GB, error {100 * (d_pred - d_meas) / d_meas:+.1f}%")
