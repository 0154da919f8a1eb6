"""bench/public_time.py: published GPU throughputs mapped to memfit runs, and the scorer (no torch)."""

import json

import pytest


from bench import public_time as pt, public_time_rows as rows

from memfit.spec.hardware import HardwareSpec, find_gpu
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy


def _published():
    if not rows.DEFAULT_FILE.is_file():
        pytest.skip(f"{rows.DEFAULT_FILE} not present")
    return {r["id"]: r for r in map(json.loads, rows.DEFAULT_FILE.read_text().splitlines()) if r}


def test_load_maps_rows_and_explains_skips():
    published = _published()
    cases, skipped = pt.load(rows.DEFAULT_FILE)
    # every row memfit can express faithfully: ~65 of 314 (peft-mmqa's 162 non-LoRA PEFT methods, litgpt's 46
    # runtime-incl-eval rows and the torch.compile / selective-AC / Float8 rows are skipped with a reason)
    assert len(cases) >= 60
    assert len(cases) + len(skipped) == len(published)
    assert {c.group for c in cases} >= {"peft-mmqa", "answerai-fsdp-qlora", "torchtitan", "torchtune", "hf-blog"}
    for s in skipped:
        assert s["reason"].strip() and s["group"] and s["id"] in published
    for c in cases:
        row = published[c.id]
        assert c.hardware.world_size == int(row["gpu"]["count"])
        assert c.published_tps_per_gpu > 0 and 0 < c.counted_fraction <= 1
        assert c.model_group.startswith(f"{c.group}/")
    compiled, _ = pt.load(rows.DEFAULT_FILE, compiled=True)
    assert len(compiled) > len(cases)


def test_mapping_details():
    _published()
    cases = {c.id: c for c in pt.load(rows.DEFAULT_FILE)[0]}
    dora = cases["peft-mmqa-time-lora-llama-3.2-3B-rank32-dora-run2026-07-15"]
    assert dora.strategy.method == "dora" and dora.strategy.precision == "bf16"
    assert dora.strategy.seq_len == 220 and dora.counted_fraction == pytest.approx(209.9 / 220)
    full = cases["peft-mmqa-time-full-finetuning-llama-3.2-3B-lr_0.00001-run2026-07-14"]
    assert full.strategy.method == "full" and full.strategy.precision == "bf16"
    off = cases["answerai-fsdp-qlora-2x4090-70b-qlora-bs2-cpuoffload"].strategy
    assert (off.fsdp, off.offload, off.quant_storage) == ("full_shard", "optimizer+params", "bf16")
    assert cases["answerai-fsdp-qlora-2x3090-7b-lora-ctx2048-bs4-ddp"].strategy.engine == "ddp"
    titan = cases["torchtitan-a100x64-llama2-13b-bs2-no-ac"]
    assert (titan.hardware.nodes, titan.hardware.gpus_per_node, titan.strategy.precision) == (8, 8, "bf16-mixed")
    assert cases["deepspeed-time-issue3901-falcon7b-4k-zero3"].published_tps_per_gpu == pytest.approx(4096 / 2.86)


def _case(cid, published):
    return pt.TimeCase(cid, "g", "g/llama-3.2-1b/L4 x1", resolve_model("llama-3.2-1b"),
                       HardwareSpec(find_gpu("L4-24GB")), Strategy(), published, "all", "high", "")


def test_score_hand_computed():
    cases = [_case("a", 100.0), _case("b", 200.0), _case("c", 400.0)]
    preds = [150.0, 120.0, 500.0]  # errors +0.5, -0.4, +0.25
    s = pt.score(cases, preds)
    for key in ("g", "all"):
        g = s[key]
        assert g["n"] == 3
        assert g["median_abs"] == pytest.approx(0.4) and g["max_abs"] == pytest.approx(0.5)
        assert g["median_signed"] == pytest.approx(0.25)
        assert g["signed"] == pytest.approx({"a": 0.5, "b": -0.4, "c": 0.25})
        # pairs: (a,b) discordant, (a,c) and (b,c) concordant -> (2 - 1) / 3
        assert g["kendall"]["g/llama-3.2-1b/L4 x1"] == {"n": 3, "tau": pytest.approx(1 / 3)}
    assert pt.score(cases[:2], preds[:2])["g"]["kendall"] == {}  # fewer than 3 rows: no tau
