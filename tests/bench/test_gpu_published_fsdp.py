"""bench/studies/gpu_published_fsdp.py: the published multi-GPU FSDP runs (gpu-runs/public-time.jsonl) predicted
in-process (the accumulation term they exposed is pinned by hand in tests/estimate/test_fsdp_accum.py).

The bench part is skipped where ../shared is absent. Its figures are the ones the bench prints
(``PYTHONPATH=. .venv/bin/python bench/studies/gpu_published_fsdp.py``), with a small margin, so a change that makes the
estimator worse on these runs fails here.
"""


import pytest


from bench.studies import gpu_published_fsdp as B, gpu_published_fsdp_rows as R

shared = pytest.mark.skipif(not R.DEFAULT_FILE.is_file(), reason=f"reference runs absent: {R.DEFAULT_FILE}")


@pytest.fixture(scope="module")
def out():
    return B.run(R.DEFAULT_FILE)


@shared
def test_rows_predicted_and_skipped(out):
    # 24 multi-GPU rows with a peak: 8 predicted, 2 brackets (torchtitan selective AC), 14 skipped with a reason
    assert out["summary"]["all"]["predicted"] == 8
    assert out["brackets"] == {"rows": 2, "inside": 2}
    assert len(out["skipped"]) == 14 and all(s["why"] for s in out["skipped"])
    engines = {r["id"]: r["engine"][:5] for r in out["rows"]}
    assert engines["litgpt-gemma-2b-full-4xA10G-dev4"] == "FSDP1"
    assert engines["torchtune-readme-2024-05-llama2-2x4090-lora"] == "FSDP1"
    assert engines["torchtune-readme-2024-09-70b-lora-8xA100"] == "FSDP2"
    assert {r["metric"] for r in out["rows"] if r["group"] == "litgpt"} == {"allocated"}


@shared
def test_published_config_rows_within_ten_percent(out):
    # measured 2026-12-02: 5 rows, median |error| 3.6 %, max 4.9 % (70B LoRA, +4.9 %), none under by 10 %
    s = out["summary"]["published_config"]
    assert s["predicted"] == 5
    assert s["median_abs"] <= 0.040
    assert s["max_abs"] <= 0.055
    assert s["under_10"] == [] and s["over_10"] == []


@shared
def test_all_rows_and_the_one_under(out):
    # with the low-reliability torchtune May 2024 rows: median 3.8 %, max 23.3 %; one row more than 10 % under
    # (4 x RTX 4090 full, 24.1 GB: the same figure as the table's 1 x 4090 PagedAdamW row; shape unpublished)
    s = out["summary"]["all"]
    assert s["median_abs"] <= 0.042
    assert s["max_abs"] <= 0.24
    assert s["under_10"] == ["torchtune-readme-2024-05-llama2-4x4090-full"]


@shared
def test_gemma_accumulation_row(out):
    # LitGPT Gemma-2B, FSDP1 over 4 x A10G, micro-batch 1 x 4 accumulation: 17.43 GB allocated published;
    # without no_sync's unsharded gradients memfit said 12.88 GB (-26 %), with them 16.90 GB (-3.1 %)
    row = next(r for r in out["rows"] if r["id"] == "litgpt-gemma-2b-full-4xA10G-dev4")
    assert row["ga"] == 4 and row["metric"] == "allocated"
    assert -0.05 <= row["error"] <= 0.0
