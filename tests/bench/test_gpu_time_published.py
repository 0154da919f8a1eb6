"""bench/gpu_time_published.py: a published throughput row against a hand call of memfit's estimate."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_time_published as G

from memfit.estimate import estimate
from memfit.spec.hardware import GiB, HardwareSpec, find_gpu
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy

ROOT = Path(__file__).resolve().parents[2]

ROW = {"id": "fms-main-none-lora-Mistral-7B-v0.1-1gpu-bs4", "source_group": "fms-main", "status": "success",
       "gpu": {"model": "NVIDIA A100 80GB", "count": 1}, "engine": "single GPU, launched with plain `python`",
       "model": "mistralai/Mistral-7B-v0.1", "method": "lora",
       "lora": {"r": 16, "alpha": 16, "dropout": 0.1, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
       "quantization": "none", "precision": "base weights bfloat16, no AMP flag",
       "gradient_checkpointing": "yes", "attention_implementation": "flash_attention_2 (use_flash_attn: True)",
       "sequence_length": {"value": 4096}, "micro_batch_size": 4, "grad_accumulation": 1,
       "primary_memory": {"value": 26704571904, "unit": "bytes", "metric_class": "torch_max_memory_allocated"},
       "reliability": "high", "train_tokens_per_second": 3324.155}


def test_row_equals_a_hand_call_of_estimate(tmp_path):
    path = tmp_path / "runs.jsonl"
    oom = {**ROW, "id": "oom", "status": "failed (OOM)"}
    path.write_text(json.dumps(ROW) + "\n" + json.dumps(oom) + "\n")
    out = G.run(path, [])
    assert [r["id"] for r in out["rows"]] == [ROW["id"]]  # the OOM row has no throughput to compare
    row = out["rows"][0]
    hw = HardwareSpec(gpu=find_gpu("A100-80GB"), gpus_per_node=1, cpu_ram_bytes=2048 * GiB)
    st = Strategy(method="lora", lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), lora_dropout=0.1,
                  micro_batch_size=4, grad_accum=1, seq_len=4096, gradient_checkpointing=True, attention="fa2",
                  precision="bf16-mixed")
    t = estimate(resolve_model("mistral-7b"), hw, st, margin=0.0).time
    assert row["predicted_tps"] == t["tokens_per_second"]
    assert row["predicted_step_s"] == t["step_seconds"]
    assert row["published_step_s"] == pytest.approx(4 * 4096 / 3324.155)
    assert row["error"] == pytest.approx(t["tokens_per_second"] / 3324.155 - 1.0)
    assert row["basis"] == "catalog GPU, parts model (memfit.steptime), uncalibrated"
    summary = out["groups"]["fms-main"]
    assert summary["rows"] == 1 and summary["median_abs"] == pytest.approx(abs(row["error"]))


def test_all_rows_finite_without_torch():
    """Every throughput row of the shared file and memfit's H200 runs predicts finite numbers, no torch."""
    if not G.gp.DEFAULT_FILE.is_file():
        pytest.skip("gpu-runs/public.jsonl not present")
    code = ("import sys, json; from bench import gpu_time_published as G\n"
            "out = G.run(G.gp.DEFAULT_FILE, G.GPU_CHECKS)\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'rows': [[r['group'], r['predicted_tps'],"
            " r['published_tps'], r['error']] for r in out['rows']], 'skipped': len(out['skipped'])}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "MEMFIT_HWCAL": "off", "PATH": "/usr/bin:/bin"})
    got = json.loads(res.stdout)
    assert not got["torch"]
    groups = [g for g, *_ in got["rows"]]
    assert groups.count("fms-main") == 10 and groups.count("gpu-check-h200") == 18
    assert groups.count("deepspeed") == 4 and got["skipped"] == 1
    assert all(math.isfinite(x) and x > 0 for _, p, m, _e in got["rows"] for x in (p, m))
