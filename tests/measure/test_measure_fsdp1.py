"""FSDP1 on two gloo processes (#39): with a sharded or adapter-only final save (no full-state-dict gather, which
crashes under gloo) `memfit measure --fsdp-version 1 --set distributed.nproc=2` runs on the CPU, and each rank's
allocator-level peak is within 3 % of the estimate (demo model, 512 tokens)."""

import pytest

from memfit.measure.runner import measure
from memfit.spec.run import run_from_dict


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from memfit.train.demo import ensure_demo_assets

    return ensure_demo_assets(tmp_path_factory.mktemp("demo"))[0]


@pytest.mark.slow
@pytest.mark.parametrize("method, save", [("lora", "adapter"), ("full", "sharded")])
def test_fsdp1_two_gloo_ranks_peak_within_3_percent(demo_model, tmp_path, method, save):
    run = run_from_dict({"model": str(demo_model), "hardware": "local", "output_dir": str(tmp_path / "out"),
                         "strategy": {"method": method, "fsdp": "full_shard", "fsdp_version": 1, "precision": "fp32",
                                      "seq_len": 512, "micro_batch_size": 1},
                         "distributed": {"nproc": 2}, "save": {"mode": save}})
    rec = measure(run, warmup=1, steps=2)
    assert rec["measured"]["peak_allocated_bytes"] > 0
    assert abs(rec["error_pct"]["total"]) < 3.0, rec["rows"]


@pytest.mark.slow
def test_fsdp1_adapter_save_on_two_gloo_ranks_reloads(demo_model, tmp_path):
    """save.mode=adapter gathers lora_A / lora_B unit by unit and writes them as PEFT does (PEFT's own save finds
    no key under FSDP1's nested units: memfit.train.adapter_save); the adapter reloads with its trained values."""
    import subprocess
    import sys

    import torch
    import yaml
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from memfit.train.demo import ensure_demo_assets

    data = ensure_demo_assets(demo_model.parent)[1]
    run = {"model": str(demo_model), "hardware": "local", "output_dir": str(tmp_path / "out"),
           "data": {"path": str(data), "format": "dialogue_summary", "eval_fraction": 0.05},
           "strategy": {"method": "lora", "fsdp": "full_shard", "fsdp_version": 1, "precision": "fp32",
                        "seq_len": 128, "micro_batch_size": 2},
           "training": {"max_steps": 2}, "distributed": {"nproc": 2}, "save": {"mode": "adapter"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    done = subprocess.run([sys.executable, "-m", "memfit", "train", str(tmp_path / "run.yaml"), "--nproc", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = load_file(str(tmp_path / "out" / "adapter" / "adapter_model.safetensors"))
    assert saved and all(".default" not in k and "_fsdp" not in k for k in saved)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(demo_model)),
                                      str(tmp_path / "out" / "adapter"))
    params = dict(model.named_parameters())
    for key, value in saved.items():
        assert torch.equal(params[key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")],
                           value)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in saved.items())  # trained


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "adapter"])
def test_save_phase_on_two_gloo_ranks_within_5_percent(tmp_path, mode):
    """The checkpoint-save phase (#39 item 5): rank 0's allocator peak during memfit train's final save (FSDP2 LoRA,
    demo model; bench/save_phase_cpu.py) against the estimate's save phase less its static lines: the full state
    dict gathered on rank 0 + one parameter being gathered, or every rank's adapter copy + the matrix in flight.
    (A sharded save's few hundred kB are not held to 5 %: they vary run to run.)"""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import save_phase_cpu

    r = save_phase_cpu.measure(mode, tmp_path)
    assert abs(r["error_pct"]) < 5.0, r
