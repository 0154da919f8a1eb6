"""The memory probe: exact on known allocation patterns, and a real step's breakdown sums to its peak."""

import mmap

import pytest

torch = pytest.importorskip("torch")

from memfit.measure import probe as P  # noqa: E402
from memfit.measure.compare import compare, error_pct, measured_by_component, summarize  # noqa: E402
from memfit.measure.runner import merge_ranks, sweep_overrides  # noqa: E402


def test_known_allocation_pattern_is_exact():
    keep = torch.ones(1000)  # 4000 B live before the window and used inside it
    with P.TensorMemoryProbe("cpu", baseline=lambda: [keep]) as probe:
        a = torch.empty(10_000, dtype=torch.uint8)   # 10,000
        b = torch.ones(3000)                         # 12,000  -> 26,000 live
        del a                                        # 16,000
        d = torch.empty(500, dtype=torch.float64)    # 4,000   -> 20,000
        e = b * 2 + keep.sum()                       # b*2 12,000 + sum 4 + e 12,000 -> 44,004
        del e
        del d
    r = probe.result()
    assert r.peak_allocated_bytes == 44_004
    assert r.raw_events_peak_bytes == 44_004
    assert r.baseline_bytes == 4000
    assert sum(r.components.values()) == r.peak_allocated_bytes


def test_peak_is_the_maximum_not_the_end():
    with P.TensorMemoryProbe("cpu", baseline=lambda: []) as probe:
        big = torch.empty(1 << 20, dtype=torch.uint8)
        del big
        small = torch.empty(1000, dtype=torch.uint8)
    assert probe.result().peak_allocated_bytes == 1 << 20
    del small


def test_training_step_breakdown_sums_and_matches_model_states(tiny_llama):
    torch.set_num_threads(1)
    model = tiny_llama(0, attention="sdpa", vocab_size=512, intermediate_size=172, max_position_embeddings=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 512, (2, 128))

    def step():
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: creates the optimizer state

    def baseline():
        yield from model.parameters()
        for st in opt.state.values():
            yield from (v for v in st.values() if torch.is_tensor(v))

    vocab_logits = {2 * s * 512 * 4 for s in (128, 127)}
    with P.TensorMemoryProbe("cpu", baseline=baseline, logits_bytes=lambda n: n in vocab_logits) as probe:
        step()
    r = probe.result()
    comps = r.components
    assert sum(comps.values()) == r.peak_allocated_bytes
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    assert comps["parameters"] == param_bytes
    assert comps["optimizer_state"] == state_bytes
    assert comps["logits"] >= 2 * 128 * 512 * 4  # at least the fp32 logits are live at the peak
    assert comps["activations"] > 0
    # the two independent figures agree (the raw one misses only the integer input batch)
    assert abs(r.raw_events_peak_bytes - r.peak_allocated_bytes) <= x.numel() * 8 * 2


def test_peak_rss_reset_and_growth():
    if not P.reset_peak_rss():
        pytest.skip("this OS does not let a process reset its peak RSS")
    before = P.peak_rss_bytes()
    # fresh anonymous pages: a bytearray may be served from free chunks glibc already holds resident
    # (an earlier test's frees in this long-lived process), and then the RSS does not grow (seen in CI)
    buf = mmap.mmap(-1, 64 << 20)
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    assert P.peak_rss_bytes() >= before + (60 << 20)
    buf.close()


def test_env_for_measurement_sets_malloc_threshold():
    env = P.env_for_measurement({})
    assert env["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_error_pct_and_compare_rows():
    assert error_pct(110, 100) == 10.0
    assert error_pct(90, 100) == -10.0
    assert error_pct(None, 100) is None and error_pct(5, 0) is None
    predicted = {"memory": {"gpu_bytes": {"weights": 100, "gradients": 0, "optimizer": 50,
                                          "activations": 300, "logits": 40, "overhead": 10, "total": 500}},
                 "time": {"step_seconds": 2.0}}
    measured = {"peak_allocated_bytes": 400, "peak_rss_bytes": 9000, "step_seconds": 1.0,
                "components": {"parameters": 100, "optimizer_state": 40, "activations": 200, "inputs": 10,
                               "logits": 40, "temporaries": 5, "unattributed": 5}}
    folded = measured_by_component(measured["components"])
    assert folded == {"weights": 100, "gradients": 0, "optimizer": 40, "activations": 210, "logits": 40,
                      "overhead": 10}
    out = compare(predicted, measured)
    assert out["error_pct"]["total"] == 25.0
    assert out["error_pct"]["optimizer"] == 25.0
    assert out["error_pct"]["step_seconds"] == 100.0
    metrics = {(row["component"], row["metric"]) for row in out["rows"]}
    assert ("total", "allocated") in metrics and ("process", "RSS") in metrics


def test_rss_is_compared_per_node():
    """The estimator's cpu_bytes are per node: with 2 ranks the measured side is the ranks' sum."""
    predicted = {"memory": {"gpu_bytes": {"total": 500}, "cpu_bytes": {"total": 2000}}, "time": {}}
    ranks = [{"rank": 0, "peak_rss_bytes": 1100}, {"rank": 1, "peak_rss_bytes": 900}]
    two = compare(predicted, {"peak_allocated_bytes": 400, "peak_rss_bytes": 1100, "ranks": ranks})
    assert two["error_pct"]["rss"] == 0.0  # 2000 vs 1100 + 900, not vs the peak rank's 1100 (+81.8 %)
    assert ("processes", "RSS, sum of 2 ranks") in {(r["component"], r["metric"]) for r in two["rows"]}
    one = compare(predicted, {"peak_allocated_bytes": 400, "peak_rss_bytes": 1600, "ranks": ranks[:1]})
    assert one["error_pct"]["rss"] == 25.0


def test_summarize():
    s = summarize([1.0, -3.0, None, 2.0, 10.0])
    assert s == {"n": 4, "median_abs_pct": 2.5, "max_abs_pct": 10.0}


def test_sweep_is_a_cartesian_product():
    combos = sweep_overrides(["gradient_checkpointing=true,false", "seq_len=256,1024", "lora.r=8"])
    assert len(combos) == 4
    assert ["strategy.gradient_checkpointing=true", "strategy.seq_len=256", "lora.r=8"] in combos


def test_sweep_rejects_bad_items():
    from memfit.errors import ConfigError

    with pytest.raises(ConfigError, match="KEY=V1,V2"):
        sweep_overrides(["seq_len"])


def test_merge_ranks_takes_the_peak_rank():
    r0 = {"rank": 0, "device": "cpu", "peak_allocated_bytes": 10, "peak_rss_bytes": 100,
          "components": {"parameters": 10}, "step_seconds": 1.0}
    r1 = {"rank": 1, "device": "cpu", "peak_allocated_bytes": 12, "peak_rss_bytes": 90,
          "components": {"parameters": 12}, "step_seconds": 1.5}
    m = merge_ranks([r1, r0])
    assert m["peak_allocated_bytes"] == 12 and m["components"] == {"parameters": 12}
    assert m["peak_rss_bytes"] == 100 and m["step_seconds"] == 1.5
    assert [r["rank"] for r in m["ranks"]] == [0, 1]


def test_model_states_known_at_start_are_claimed_from_unattributed():
    from memfit.measure.probe import _claim_baseline

    comps = {"parameters": 10, "optimizer_state": 0, "activations": 50, "unattributed": 40}
    out = _claim_baseline(comps, {"parameters": 30, "optimizer_state": 15, "gradients": 0})
    assert out == {"parameters": 30, "optimizer_state": 15, "activations": 50, "unattributed": 5}
    assert sum(out.values()) == sum(comps.values())


def test_root_cause_picks_the_rank_error_not_torchrun():
    from memfit.measure.runner import _root_cause

    log = ("noise\n[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: bad seq_len\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\n")
    assert _root_cause(log) == "[rank0]: ValueError: bad seq_len"


def test_unknown_estimate_lines_fold_into_overhead():
    from memfit.measure.compare import predicted_memory

    pred = {"memory": {"gpu_bytes": {"weights": 10, "activations": 20, "lora_intermediates": 5,
                                     "step_temporaries": 7, "peak_concurrency": -2, "total": 40}}}
    out = predicted_memory(pred)
    assert out["activations"] == 25 and out["overhead"] == 7 and out["correction"] == -2
    assert sum(v for k, v in out.items() if k != "total") == out["total"]
