"""The estimator's memory accuracy on the shipped published GPU runs (../shared/reference/gpu-runs/public.jsonl
+ memfit's H200 gpu-check in bench/results), and the error bars estimate/plan print from it.

Skipped where the reference file is absent. The figures pinned here are the ones the bench prints
(``PYTHONPATH=. .venv/bin/python bench/gpu_published.py``), with a small margin: a change that makes the
estimator worse on the published runs fails here, and so does a committed published_accuracy.json that
no longer matches what the bench computes (a constant changed without ``--write-accuracy``).
"""

import json

import pytest


from bench import gpu_published as G

pytestmark = pytest.mark.skipif(not G.DEFAULT_FILE.is_file(), reason=f"reference runs absent: {G.DEFAULT_FILE}")

# runs that ran but are called not fitting at the planner's 5 % margin; fixing them should shrink this set.
# fms Mistral-7B full bs4/bs8 left this set when the verdict left out the cache the allocator frees when the card is
# full (memfit.estimate.cuda.gap_parts: a step peak's cache is released). The IA3 run measured 24.85 GB reserved on a
# 4090 whose CUDA total is 25.25 GB (23.52 GiB): the whole card, over the planner's 5 % margin (23.99 GB); it is called
# not fitting (in-sample too since #39: its cached layer working sets sit in split segments).
RAN_CALLED_NOT_FITTING = {"peft-mmqa-README-example-ia3-rtx4090"}


@pytest.fixture(scope="module")
def bench():
    checks = G.default_checks(G.DEFAULT_FILE)
    public = G.load(G.DEFAULT_FILE)[0]
    cases = public + [c for p in checks for c in G.load_gpu_check(p)]
    held = G.held_out(cases)
    return {"cases": cases, "public": len(public), "held": held, "in_sample": [G.predict(c) for c in cases],
            "accuracy": G.accuracy(G.DEFAULT_FILE, checks, cases=cases, held=held)}


def test_committed_error_bars_are_current(bench):
    """bench/gpu_published.py --check, in-process: CI fails on a stale bar."""
    assert G.check(want=bench["accuracy"]) is None


def test_a_stale_bar_is_caught(bench, tmp_path):
    stale = json.loads(G.ACCURACY_FILE.read_text())
    stale["date"] = "1999-01-01"  # the date alone is not a difference
    path = tmp_path / "acc.json"
    path.write_text(json.dumps(stale))
    assert G.check(committed=path, want=bench["accuracy"]) is None
    stale["kinds"]["lora, 1 GPU"]["max_pct"] += 0.1
    path.write_text(json.dumps(stale))
    msg = G.check(committed=path, want=bench["accuracy"])
    assert msg and "\n" not in msg and "kinds.lora, 1 GPU.max_pct" in msg and "--write-accuracy" in msg
    assert G.main(["--check"]) == 0


def test_error_bars_carry_the_basis_their_record_gives(bench):
    """Each kind's label is computed from bench/provenance.json: development where a decision saw one of its
    groups, never a literal; the in-sample range beside it says so."""
    acc, record = bench["accuracy"], G.provenance.load()
    assert "held_out" not in acc and "leave-one-group-out" in acc["procedure"]
    assert acc["rows"] > 40 and acc["figures"] > 60
    assert {"full, 1 GPU", "lora, 1 GPU", "qlora, 1 GPU", "dora, 1 GPU"} <= set(acc["kinds"])
    for kind in acc["kinds"].values():
        assert kind["basis"] == G.provenance.basis("memory", kind["groups"], record)["basis"]
        assert kind["in_sample"]["basis"] == "in_sample"
    # the constants the Profile ships are the fit on every group, not moved for a row
    assert acc["profile"] == acc["fitted_all_groups"]


def test_a_provenance_record_changes_the_label(bench):
    """Clear the record of every decision that saw peft-docs's rows: its kind is held out; mark one constant as
    hand-set after seeing peft-docs: the same kind is a development figure that names the constant."""
    record = G.provenance.load()
    clean = {**record, "memory": [d for d in record["memory"] if "peft-docs" not in d["seen"]]}
    kinds = G.accuracy(cases=bench["cases"], held=bench["held"], record=clean)["kinds"]
    only = [k for k, v in kinds.items() if v["groups"] == ["peft-docs"]]
    assert only and all(kinds[k]["basis"] == "held_out" for k in only)
    marked = {**clean, "memory": clean["memory"] + [{"kind": "constant", "name": "fragmentation 0.04",
                                                     "seen": ["peft-docs"], "commit": "test", "note": ""}]}
    kinds = G.accuracy(cases=bench["cases"], held=bench["held"], record=marked)["kinds"]
    assert all(kinds[k]["basis"] == "development" and kinds[k]["hand_set"] == ["fragmentation 0.04"] for k in only)


def test_noise_floor_of_repeated_configurations(bench):
    """PEFT re-ran configurations across library versions: the bench finds them and prints their spread."""
    floor = bench["accuracy"]["noise_floor"]
    assert floor["configs"] >= 20 and floor["measurements"] > 2 * floor["configs"] - 1
    assert 0 <= floor["median_spread_pct"] <= floor["max_spread_pct"] < 20


def test_public_rows_accuracy(bench):
    """Median, worst case and under-predictions on the public rows, in-sample and held out."""
    n = bench["public"]
    ins = G.summarize(bench["in_sample"][:n])
    held = G.summarize(bench["held"][0][:n])
    # in-sample (bench/gpu_published.py: median |e| 1.1 %, max 19.7 %)
    assert ins["compared"] >= 50
    assert ins["median_abs"] < 0.015 and ins["max_abs"] < 0.20
    # held out (leave-one-group-out: median 2.3 %, max 19.7 %; 26.3 % before #39, when the cache shown was capped at
    # the card and fms-main's fit without itself kept 1.5 layer working sets cached)
    assert held["median_abs"] < 0.03 and held["max_abs"] < 0.21
    for s in (ins, held):
        assert s["under_10"] == []  # no published figure more than 10 % under its measurement
        assert s["oom_called_fitting"] == []  # no run that ran out of memory is called fitting
        assert set(s["ran_called_not_fitting"]) <= RAN_CALLED_NOT_FITTING


def test_gpu_check_rows_held_out(bench):
    """memfit's own H200 runs: with that group left out, the fit sets allocator_cached_loss to 0 (no other group
    shows the step-peak cache) and the 1B full fine-tune's reserved peak is 15.7 % under; nothing worse."""
    n = bench["public"]
    held = G.summarize(bench["held"][0][n:])
    assert held["under_10"] == ["gpu-check-h200-1b-full-gc-sdpa#reserved"]
    assert min(r["error"] for r in bench["held"][0][n:]) > -0.16


def test_estimate_json_carries_the_bar_and_its_basis():
    from memfit.estimate import estimate
    from memfit.spec.hardware import HardwareSpec, find_gpu
    from memfit.spec.model import resolve_model
    from memfit.spec.strategy import Strategy

    est = estimate(resolve_model("mistral-7b"), HardwareSpec(gpu=find_gpu("A100-80GB")), Strategy(method="full"))
    err = est.to_dict()["memory"]["published_error"]
    committed = json.loads(G.ACCURACY_FILE.read_text())
    assert err["date"] == committed["date"] and err["basis_rows"] == committed["rows"]
    kind = committed["kinds"]["full, 1 GPU"]
    assert (err["min_pct"], err["max_pct"], err["figures"]) == (kind["min_pct"], kind["max_pct"], kind["figures"])
    assert err["basis"] == kind["basis"] and err["noise_floor"] == committed["noise_floor"]
    assert err["in_sample"] == kind["in_sample"]
