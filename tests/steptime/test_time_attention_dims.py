"""SDPA on a CPU at the model's head dim: seconds per score = a + b·d through the calibration's two head dims."""

from dataclasses import replace

import pytest

from memfit.estimate import estimate
from memfit.steptime.speeds import Speeds
from memfit.spec.model import model_from_config
from memfit.spec.strategy import Strategy
from test_time_model import cpu_pool

T1, T2 = 11e-9, 7e-9  # seconds per score at d = 32 and at d = 16 (this CPU at s = 512: 11.1 and 7.0 ns)
R1 = 12 * 32 / T1  # FLOP/s at d = 32
R2 = 12 * 32 / (2 * T2)  # the half-d figure: the same FLOPs over twice the scores


def _speeds(half=True) -> Speeds:
    base = Speeds(basis="x", gemm_small=1, gemm_large=1, width_small=1, width_large=2, gemm_skinny=1,
                  attention=((256.0, R1),), bandwidth=1, op_seconds=0, overlap_dispatch=False, adam_per_param=0,
                  adam_per_tensor=0, cpu_adam_per_param=0, bus_bandwidth=1, collective_latency=0, h2d=1, d2h=1,
                  dequant=1, peak=1)
    return replace(base, attention_half_d=((256.0, R2),), attention_head_dim=32.0) if half else base


def test_rate_at_the_head_dim_by_hand():
    sp = _speeds()
    assert sp.attention_rate(256, 32) == pytest.approx(R1)
    assert sp.attention_rate(256, 16) == pytest.approx(12 * 16 / T2)  # 7 ns per score
    per_d = (T1 - T2) / 16  # 0.25 ns per unit of d
    assert sp.attention_rate(256, 64) == pytest.approx(12 * 64 / (T1 + 32 * per_d))  # 19 ns per score
    assert sp.attention_rate(256) == pytest.approx(R1)  # no head dim: the measured figure
    assert _speeds(half=False).attention_rate(256, 16) == pytest.approx(R1)  # not calibrated: as before


def test_half_d_faster_per_score_is_noise_and_ignored():
    sp = replace(_speeds(), attention_half_d=((256.0, 12 * 32 / (2 * 6e-9 + 2 * T1)),))  # per score 2x slower
    assert sp.attention_rate(256, 16) == pytest.approx(R1)


def _model(heads: int):
    return model_from_config({"model_type": "llama", "hidden_size": 128, "num_attention_heads": heads,
                              "num_key_value_heads": heads, "intermediate_size": 256, "num_hidden_layers": 2,
                              "vocab_size": 100}, name=f"h{heads}")


def test_the_estimate_uses_the_models_head_dim():
    att = {k: {"eager": {"fp32": {"256": 1e9}}, "sdpa": {"fp32": {"256": R1}}, "shape": [1, 4, [256], 32],
               "sdpa_half_d": {"fp32": {"256": R2}}} for k in ("1", "2")}
    pool = cpu_pool(1, attention=att)
    st = Strategy(method="full", seq_len=256, micro_batch_size=1, precision="fp32", attention="sdpa")
    d32, d16 = (estimate(_model(h), pool, st).time["attention_seconds"] for h in (4, 8))  # head dim 32, 16
    assert d16 / d32 == pytest.approx(T2 * 2 / T1)  # the same FLOPs, twice the scores at 7/11 the time each
    plain = cpu_pool(1, attention={k: {kk: v for kk, v in a.items() if kk != "sdpa_half_d"} for k, a in att.items()})
    assert estimate(_model(8), plain, st).time["attention_seconds"] == pytest.approx(d32)


# eager attention's batched products (q·kᵀ, p·v) on the same line: their outputs do not shrink with d
B1, B2 = 10e-9, 8e-9  # seconds per score at d = 32 and d = 16 (this CPU: 9-11 and 6.4-11.6 ns)


def test_eager_products_at_the_head_dim_by_hand():
    sp = replace(_speeds(half=False), eager_bmm=12 * 32 / B1, eager_bmm_half_d=12 * 32 / (2 * B2), eager_head_dim=32.0)
    assert sp.eager_bmm_rate(32) == pytest.approx(12 * 32 / B1)
    assert sp.eager_bmm_rate(16) == pytest.approx(12 * 16 / B2)  # 8 ns per score: 24 GFLOP/s, not 19.2 x 2
    assert sp.eager_bmm_rate(64) == pytest.approx(12 * 64 / (B1 + 32 * (B1 - B2) / 16))  # 14 ns per score
    assert replace(sp, eager_bmm_half_d=0.0).eager_bmm_rate(16) == pytest.approx(12 * 32 / B1)  # uncalibrated


def test_the_eager_estimate_uses_the_models_head_dim():
    parts = {"bmm": 12 * 32 / B1, "bmm_half_d": 12 * 32 / (2 * B2), "bmm_head_dim": 32,
             "scores": {"1024": 1e-12}, "scores_forward_share": 0.5}
    att = {k: {"eager": {"fp32": {"256": 1e9}}, "sdpa": {"fp32": {"256": R1}}, "shape": [1, 4, [256], 32],
               "eager_parts": {"fp32": parts}} for k in ("1", "2")}
    st = Strategy(method="full", seq_len=256, micro_batch_size=1, precision="fp32", attention="eager")
    d32, d16 = (estimate(_model(h), cpu_pool(1, attention=att), st).time["attention_seconds"] for h in (4, 8))
    scores = 4 * 256 * 256 * 2  # heads x s² x layers at d = 32; twice the heads at d = 16
    assert d32 == pytest.approx(scores * (B1 + 1e-12), rel=1e-6)
    assert d16 == pytest.approx(2 * scores * (B2 + 1e-12), rel=1e-6)
