"""The GPU time model's held-out error bars: regenerated from the public rows, never stale."""

import json
from dataclasses import replace

import pytest


from bench import gpu_time_fit as F, public_time_rows

needs_rows = pytest.mark.skipif(not public_time_rows.DEFAULT_FILE.is_file(), reason="gpu-runs/public-time.jsonl absent")


@needs_rows
def test_committed_time_error_bars_are_current(capsys):
    assert F.check(F.all_rows()) == 0, capsys.readouterr().err


@needs_rows
def test_held_out_figures_on_public_rows_do_not_regress():
    # the figures docs/gpu-time.md reports (bench/gpu_time_fit.py): held out over every judged row
    scored = F.judged(F.all_rows())
    held, _ = F.held_out(scored)
    cases = F.named(scored)  # the named methods' rows (method=peft rows are scored apart)
    preds = [p for c, p in zip(scored, held) if c.strategy.method != "peft"]
    s = F.summary(cases, preds)
    assert s["n"] >= 80
    assert s["median_abs"] <= 0.12  # docs/gpu-time.md: 10.3 % held out (no fitted constant rests on one group)
    # memfit's H200 runs: the host constant is measured (not fitted), so leaving them out no longer swings it
    h200 = [(c, p) for c, p in zip(cases, preds) if c.group == "gpu-check-h200"]
    assert F.summary([c for c, _ in h200], [p for _, p in h200])["median_abs"] <= 0.15
    fms = [(c, p) for c, p in zip(cases, preds) if c.group == "fms-main"]
    kendall = F.summary([c for c, _ in fms], [p for _, p in fms])["kendall"]
    assert kendall["fms-main/mistral-7b/A100-80GB x1"]["tau"] >= 0.8


def test_seed_runtime_findings():
    from bench import seed_time_checks

    checks = seed_time_checks.run()
    assert len(checks) == 5
    assert all(c["ok"] for c in checks), [f"{c['finding']}: {c['detail']}" for c in checks if not c["ok"]]


def test_estimate_json_carries_the_time_error_bar():
    from memfit.estimate import estimate
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model
    from memfit.spec.strategy import Strategy

    t = estimate(resolve_model("llama-2-7b"), parse_hardware("A100-80GB"), Strategy(method="lora")).to_dict()["time"]
    err = t["published_error"]
    assert err["basis"] == "development" and err["kind"] == "lora, 1 GPU" and err["rows"] >= 10
    from bench import provenance

    want = provenance.basis("time", err["groups"], provenance.load())
    assert err["hand_set"] == want["hand_set"] and len(want["hand_set"]) >= 3 and err["rests_on"] == want["rests_on"]
    assert err["overall"]["basis"] == "development"
    assert err["min_pct"] < 0 < err["max_pct"]


@needs_rows
def test_peft_rows_are_scored_never_fitted():
    """PEFT's method comparison (any PEFT method from its config, method=peft) is scored beside the named
    methods: it moves no fitted constant, and it has its own held-out kind and per-method table."""
    pytest.importorskip("peft")
    cases = F.judged(F.all_rows())
    peft = [c for c in cases if c.strategy.method == "peft"]
    assert len(peft) >= 100 and {F.gtp.gp.peft_type(c) for c in peft} >= {"IA3", "PROMPT_TUNING", "BOFT", "VERA"}
    # the fit reads no method=peft row: their published figures halved, the constants do not move
    halved = [c if c.strategy.method != "peft" else replace(c, published_tps_per_gpu=c.published_tps_per_gpu / 2)
              for c in cases]
    assert F.fit(halved) == F.fit(cases)
    acc = F.accuracy(cases)
    assert acc["rows"] == len(F.named(cases)) and acc["kinds"]["peft, 1 GPU"]["rows"] == len(peft)
    assert set(acc["peft_methods"]) == {F.gtp.gp.peft_type(c) for c in peft}


def test_a_peft_method_estimate_carries_its_own_time_error_bar():
    pytest.importorskip("peft")
    from memfit.estimate import estimate
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model
    from memfit.spec.strategy import Strategy

    ia3 = {"peft_type": "IA3", "target_modules": ["k_proj", "v_proj", "down_proj"],
           "feedforward_modules": ["down_proj"]}
    st = Strategy(method="peft", peft_config=ia3, precision="bf16", micro_batch_size=4, seq_len=768)
    err = estimate(resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB"),
                   st).to_dict()["time"]["published_error"]
    # a development figure: the per-type rules were written against these very rows
    assert err["kind"] == "peft, 1 GPU" and err["rows"] >= 100 and err["basis"] == "development"
    from memfit.steptime.accuracy import DATA

    kind = json.loads(DATA.read_text())["kinds"]["peft, 1 GPU"]  # the bar is the held-out range of those rows
    assert (err["min_pct"], err["max_pct"]) == (kind["min_pct"], kind["max_pct"]) and err["max_pct"] > 20
