"""The catalog (uncalibrated GPU) time model's physics: a mixture's expert FLOPs, causal fused attention."""

import pytest

from memfit.estimate import Profile, estimate
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy

ST = dict(method="lora", micro_batch_size=2, seq_len=1024, gradient_checkpointing=False, attention="sdpa",
          precision="bf16-mixed", lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))


def test_mixture_counts_top_k_experts_and_dequantises_all():
    mix = resolve_model("mixtral-8x7b")
    t = estimate(mix, parse_hardware("A100-80GB"), Strategy(**ST)).time
    T, L, h, f, V = 2 * 1024, 32, 4096, 14336, 32000
    # frozen linears: forward + input gradient (4 FLOPs per k*n and token); attention 4096^2 + 2 x 4096x1024,
    # the router 4096x8, and top-2 of the 8 experts' three 4096x14336 linears; the head 4096 x V likewise
    per_layer = h * h * 2 + 2 * h * 1024 + h * 8 + 2 * 3 * h * f
    assert t["dense_flops"] == 2 * T * per_layer * 2 * L + 2 * T * h * V * 2
    # QLoRA: every expert's weights are dequantised per use (forward, input gradient), all 8 of them
    q = estimate(mix, parse_hardware("A100-80GB"), Strategy(**{**ST, "method": "qlora"})).time
    bw = 2039e9 * Profile().memory_bandwidth_efficiency
    values = (h * h * 2 + 2 * h * 1024 + h * 8 + 8 * 3 * h * f) * L * 2
    assert q["dequant_seconds"] == pytest.approx(values / (bw / 2.5))


def test_causal_fused_attention_does_half_the_square():
    m = resolve_model("llama-3.2-1b")
    hw = parse_hardware("A100-80GB")
    prof = Profile(utilization_attention_fused=0.5)
    fused = estimate(m, hw, Strategy(**ST), profile=prof).time
    flops = 12 * 2 * 1024 * 1024 * m.q_dim * m.layers
    assert fused["attention_seconds"] == pytest.approx(flops * 0.5 / (0.5 * 312e12))
    # eager materialises the whole square: the slowdown on the GEMM rate, no causal saving
    eager = estimate(m, hw, Strategy(**{**ST, "attention": "eager"}), profile=prof).time
    assert eager["attention_seconds"] == pytest.approx(
        flops / (312e12 * prof.utilization / prof.eager_attention_slowdown))
