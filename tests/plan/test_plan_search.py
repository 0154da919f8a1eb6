"""The planner: fastest combination that fits, with the margin kept, and explanations that add up."""

import pytest

from memfit.errors import ConfigError
from memfit.estimate import estimate
from memfit.plan import rules
from memfit.plan.gpu_count import gpu_count_search
from memfit.plan.search import plan
from memfit.plan.space import enumerate_strategies
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model

LLAMA7 = resolve_model("llama-2-7b")
LLAMA13 = resolve_model("llama-2-13b")
LLAMA70 = resolve_model("llama-2-70b")
A100 = parse_hardware("8xA100-80GB")
V100 = parse_hardware("8xV100-32GB")


def test_recommends_the_fastest_fitting_combination_of_a_brute_force_search():
    p = plan(LLAMA13, V100, seq_len=1024, micro_batch_size=1)
    # independent brute force over the same space: rules, then the estimator's verdict
    fitting = []
    for s in enumerate_strategies(LLAMA13, V100, seq_len=1024, micro_batch_size=1):
        if not rules.check(LLAMA13, V100, s):
            e = estimate(LLAMA13, V100, s, margin=0.05)
            if e.fits:
                fitting.append(e)
    assert len(p.candidates) == len(fitting) > 0
    assert p.recommended is p.candidates[0]
    assert p.recommended.step_seconds == min(e.step_seconds for e in fitting)
    steps = [c.step_seconds for c in p.candidates]
    assert steps == sorted(steps)
    assert len(p.candidates) + len(p.rejected) == len(list(enumerate_strategies(
        LLAMA13, V100, seq_len=1024, micro_batch_size=1)))


def test_every_candidate_keeps_the_margin_free():
    for margin in (0.0, 0.2):
        p = plan(LLAMA7, V100, seq_len=2048, micro_batch_size=1, margin=margin)
        cap = V100.gpu.memory_bytes * (1 - margin)
        # what the card must hold keeps the margin free; the cache beyond it is freed on demand, never past the card
        assert p.candidates and all(c.gpu_needed <= cap for c in p.candidates)
        assert all(c.gpu_total <= V100.gpu.memory_bytes for c in p.candidates)


def test_a_larger_margin_never_gives_a_faster_plan():
    loose = plan(LLAMA13, V100, seq_len=2048, micro_batch_size=1, margin=0.0)
    tight = plan(LLAMA13, V100, seq_len=2048, micro_batch_size=1, margin=0.25)
    loose_labels = {c.strategy.label() for c in loose.candidates}
    assert {c.strategy.label() for c in tight.candidates} <= loose_labels
    assert len(tight.candidates) < len(loose.candidates)
    assert loose.recommended.step_seconds <= tight.recommended.step_seconds


def test_rejections_carry_their_reason_and_shortfall():
    p = plan(LLAMA13, V100, seq_len=2048, micro_batch_size=1)
    mem = [r for r in p.rejected if r.kind == "memory"]
    rule = [r for r in p.rejected if r.kind == "rule"]
    assert mem and rule
    for r in mem:
        assert r.short_bytes > 0 and r.over_ratio > 1
        assert "GB" in r.reason and "over by" in r.reason
    assert any("FlashAttention-2" in r.reason for r in rule)  # V100 has none
    assert all(r.strategy.precision == "fp16-mixed" for r in p.rejected)  # V100 has no bf16
    d = p.to_dict()
    assert set(d) >= {"recommended", "candidates", "rejected"}
    assert d["recommended"]["strategy"] == p.recommended.to_dict()["strategy"]
    assert set(d["rejected"][0]) == {"strategy", "reason"}


def test_why_names_the_choice_the_runner_ups_and_what_did_not_fit():
    p = plan(LLAMA13, V100, seq_len=2048, micro_batch_size=1)
    rec = p.recommended.strategy.label()
    assert p.why[0].startswith(f"{rec} is the fastest of the {len(p.candidates)} combinations that fit")
    assert any(w.startswith("Runner-up") for w in p.why)
    faster = [w for w in p.why if w.startswith("Faster but does not fit")]
    assert faster and all("GB over" in w for w in faster)
    assert any(w.startswith("Ruled out") and "FlashAttention-2" in w for w in p.why)


def test_nothing_fits_says_what_is_closest_and_what_would_fit():
    t4 = parse_hardware("1xT4-16GB")
    p = plan(LLAMA70, t4, seq_len=2048, micro_batch_size=1, methods=["full", "lora"], allow_offload=False)
    assert p.recommended is None and not p.candidates
    assert p.closest is not None and p.closest.strategy.gradient_checkpointing
    text = " ".join(p.why)
    assert "Nothing fits" in text and "Closest:" in text
    assert "xT4-16GB it would fit" in text  # a bigger pool of the same GPU, found by searching it
    assert p.to_dict()["recommended"] is None


def test_fixed_keys_and_restrictions_hold():
    p = plan(LLAMA70, A100, seq_len=1024, micro_batch_size=1, fixed={"method": "qlora"})
    assert {c.strategy.method for c in p.candidates} == {"qlora"}
    assert all(c.strategy.quant_storage == "bf16" for c in p.candidates
               if c.strategy.zero_stage == 3 or c.strategy.fsdp)
    p = plan(LLAMA7, A100, seq_len=512, micro_batch_size=1, methods=["full"], zero_stages=[2, 3],
             allow_offload=False)
    assert {c.strategy.engine for c in p.candidates} <= {"zero2", "zero3"}
    assert {c.strategy.offload for c in p.candidates} == {"none"}


def test_bad_margin_is_refused():
    with pytest.raises(ConfigError, match="--margin"):
        plan(LLAMA7, A100, seq_len=512, micro_batch_size=1, margin=1.5)


def test_plan_on_a_fa2_gpu_prefers_fa2_or_sdpa_never_eager_first():
    p = plan(LLAMA7, A100, seq_len=4096, micro_batch_size=1)
    assert p.recommended.strategy.attention in ("fa2", "sdpa")
    assert p.recommended.strategy.precision == "bf16-mixed"


def test_gpu_count_search_adds_time_and_cost():
    r = gpu_count_search(LLAMA70, "RTX3090-24GB", max_gpus=4, cpu_ram="256GB", price=0.33,
                         tokens=1_000_000, seq_len=1024, micro_batch_size=1, fixed={"method": "qlora"})
    assert [row.gpus for row in r.rows] == [1, 2, 3, 4]
    fitting = [row for row in r.rows if row.recommended is not None]
    assert fitting
    for row in fitting:
        assert row.steps == -(-1_000_000 // (row.gpus * 1024))
        assert row.hours == pytest.approx(row.steps * row.recommended.step_seconds / 3600)
        assert row.cost == pytest.approx(row.hours * row.gpus * 0.33)
    assert r.best is min(fitting, key=lambda row: row.cost)
    assert r.to_dict()["best_gpus"] == r.best.gpus


def test_gpu_count_search_bad_input():
    with pytest.raises(ConfigError, match="--tokens and --steps"):
        gpu_count_search(LLAMA7, "RTX3090-24GB", max_gpus=2, tokens=10, steps=10, seq_len=512, micro_batch_size=1)
    with pytest.raises(ConfigError, match="without a count"):
        gpu_count_search(LLAMA7, "2xRTX3090-24GB", max_gpus=2, seq_len=512, micro_batch_size=1)
    with pytest.raises(ConfigError, match="--max-gpus 0"):
        gpu_count_search(LLAMA7, "RTX3090-24GB", max_gpus=0, seq_len=512, micro_batch_size=1)


def test_plan_on_the_cpu_device():
    cpu = parse_hardware("CPU", cpu_ram="64GB")
    p = plan(LLAMA7, cpu, seq_len=256, micro_batch_size=1)
    assert p.recommended is not None
    assert {c.strategy.precision for c in p.candidates} == {"fp32"}
    assert all(c.strategy.offload == "none" and c.strategy.attention != "fa2" for c in p.candidates)
    assert all(c.strategy.engine == "ddp" for c in p.candidates)  # one process: nothing to shard over
    assert "of RAM" in p.why[0]


def test_cpu_pool_counts_every_process_in_one_ram():
    from memfit.plan.search import ram_need

    pool = parse_hardware("2xCPU", cpu_ram="64GB")
    p = plan(LLAMA7, pool, seq_len=256, micro_batch_size=1)
    usable = 64e9 * 0.95
    assert p.candidates and all(ram_need(c, pool) <= usable for c in p.candidates)
    assert all(ram_need(c, pool) == 2 * c.gpu_total + c.cpu_total for c in p.candidates)
    missed = [r for r in p.rejected if r.kind == "memory"]
    assert missed and all(ram_need(r.estimate, pool) > usable for r in missed)


def test_meft_listed_says_what_it_buys_and_its_case():
    """Where MEFT is listed, the explanation says its trainable share, that its store stays in CPU RAM, its
    case (knowledge-heavy data) and memfit's own miniature result; a plan without MEFT says none of it."""
    from memfit.plan.search import plan
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model

    model, hw = resolve_model("llama-2-7b"), parse_hardware("1xRTX4090-24GB")
    p = plan(model, hw, seq_len=1024, micro_batch_size=1, methods=["meft"])
    e = p.recommended
    note = [w for w in p.why if w.startswith("MEFT trains")]
    assert len(note) == 1
    assert (f"{e.trainable_parameters / 1e9:.2f} B parameters "
            f"({e.trainable_parameters / model.parameters:.0%}") in note[0]
    assert f"({e.cpu['meft_store'] / 1e9:.1f} GB) stays in CPU RAM" in note[0]
    assert "knowledge-heavy" in note[0] and "docs/meft.md" in note[0]
    assert not any("MEFT" in w for w in plan(model, hw, seq_len=1024, micro_batch_size=1, methods=["lora"]).why)
