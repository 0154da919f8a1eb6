"""The planner with the long-context levers (issue 36): lengths nothing fits as is plan with a lever, say so in
their "why", and answer in under a second."""

import time

from memfit.plan import plan
from memfit.plan.longctx import variants
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy
from tests.conftest import own_heap


def _timed(model: str, gpus: str, seq_len: int):
    """The plan's CPU time, as a fresh `memfit plan` process spends it (tests/conftest.py own_heap)."""
    m, hw = resolve_model(model), parse_hardware(gpus)
    with own_heap():
        t = time.process_time()
        p = plan(m, hw, seq_len=seq_len, micro_batch_size=1)
        return p, time.process_time() - t


def test_llama_8b_at_512k_on_8_h100_plans_with_sequence_parallelism():
    p, seconds = _timed("llama-3.1-8b", "8xH100-80GB", 524288)
    rec = p.recommended
    assert rec is not None and rec.fits
    assert rec.strategy.sequence_parallel == 8 or rec.strategy.context_parallel == 8
    assert any(line.startswith("No combination fits 524288 tokens as is: ") for line in p.why)
    assert any("past llama-3.1-8b's trained length 131072" in line for line in p.why)  # the RoPE note
    assert seconds < 1.0


def test_llama_70b_at_256k_on_two_nodes_plans_with_a_lever():
    p, seconds = _timed("llama-3.1-70b", "2x8xH100-80GB", 262144)
    rec = p.recommended
    assert rec is not None
    s = rec.strategy
    assert s.sequence_parallel > 1 or s.context_parallel > 1 or s.activation_offload != "none"
    assert seconds < 1.0


def test_levers_are_not_tried_where_a_combination_fits():
    p, _ = _timed("llama-3.1-8b", "8xH100-80GB", 4096)
    levers = [c for c in p.candidates if c.strategy.sequence_parallel > 1 or c.strategy.tiled_mlp]
    assert p.recommended is not None and not levers


def test_fixed_levers_are_held_and_eager_attention_is_left_out():
    hw = parse_hardware("8xH100-80GB")
    base = [Strategy(method="full", zero_stage=3, gradient_checkpointing=True, attention=a) for a in ("sdpa", "eager")]
    out = list(variants(base, hw, None))
    assert out and all(v.attention == "sdpa" for v in out)
    assert {v.sequence_parallel for v in out} == {1, 2, 4, 8}
    assert list(variants(base, hw, {"sequence_parallel": 1})) == []
