"""The catalog GPU time model's physics on real shapes: a mixture's expert FLOPs and dequantisation, causal
fused attention (memfit.steptime)."""

import pytest

from memfit.estimate import Profile, estimate
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy
from memfit.steptime.attention import fused_seconds
from memfit.steptime.micro import NF4_BYTES_PER_VALUE
from memfit.steptime.rates import gpu_rates

ST = dict(method="lora", micro_batch_size=2, seq_len=1024, gradient_checkpointing=False, attention="sdpa",
          precision="bf16-mixed", lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))


def test_mixture_counts_top_k_experts_and_dequantises_all():
    mix = resolve_model("mixtral-8x7b")
    hw = parse_hardware("A100-80GB")
    t = estimate(mix, hw, Strategy(**ST)).time
    T, L, h, f, V = 2 * 1024, 32, 4096, 14336, 32000
    # frozen linears: forward + input gradient (4 FLOPs per k*n and token); attention 4096^2 + 2 x 4096x1024,
    # the router 4096x8, and top-2 of the 8 experts' three 4096x14336 linears; the head 4096 x V likewise
    per_layer = h * h * 2 + 2 * h * 1024 + h * 8 + 2 * 3 * h * f
    assert t["dense_flops"] == 2 * T * per_layer * 2 * L + 2 * T * h * V * 2
    # QLoRA: every expert's weight is dequantised per use (forward, input gradient), all 8 of them, each its own
    # kernel moving 0.5 B read + 2 B written (+ absmax) per value at the bandwidth of its size
    q = estimate(mix, hw, Strategy(**{**ST, "method": "qlora"})).time
    g = gpu_rates(hw.gpu, "bf16-mixed", Profile())
    sizes = [(h * h, 1), (h * 1024, 2), (h * h, 1), (h * 8, 1), (h * f, 24)]  # q, k+v, o, router, 8 x 3 experts
    per_use = sum(c * n * NF4_BYTES_PER_VALUE / g.bandwidth(n * NF4_BYTES_PER_VALUE) for n, c in sizes)
    assert q["dequant_seconds"] == pytest.approx(per_use * L * 2)


def test_causal_fused_attention_and_eager_square():
    m = resolve_model("llama-3.2-1b")
    hw = parse_hardware("A100-80GB")
    fused = estimate(m, hw, Strategy(**ST)).time
    g = gpu_rates(hw.gpu, "bf16-mixed", Profile())
    assert fused["attention_seconds"] == pytest.approx(m.layers * fused_seconds(2, m.heads, 1024, m.head_dim, g, 0.5))
    # eager materialises the whole square (its scores through memory): slower than the fused kernel
    eager = estimate(m, hw, Strategy(**{**ST, "attention": "eager"})).time
    assert eager["attention_seconds"] > 2 * fused["attention_seconds"]


def test_geforce_without_peer_to_peer_collects_through_host_memory():
    """RTX 3090 / 4090 have no peer-to-peer: NCCL's SHM path at shm_bus_fraction of the PCIe link; cards with
    NVLink or PCIe peer-to-peer keep intra_node_bandwidth x intra_node_efficiency."""
    from memfit.steptime.speeds import speeds_for

    p = Profile()
    for pool, p2p in (("2xRTX3090-24GB", False), ("2xRTX4090-24GB", False), ("2xA100-80GB", True),
                      ("2xRTX6000Ada-48GB", True)):
        hw = parse_hardware(pool)
        bus = speeds_for(hw, "bf16-mixed", "sdpa", p).bus_bandwidth
        nvlink = hw.gpu.intra_node_bandwidth * p.intra_node_efficiency
        assert bus == pytest.approx(min(nvlink, hw.gpu.pcie_bandwidth * 0.31) if not p2p else nvlink), pool
    # so an FSDP LoRA step of a 7B on 2 x 3090 spends ~2.3x longer in its all-gathers than at P2P speed
    m, st = resolve_model("llama-2-7b"), Strategy(method="lora", fsdp="full_shard", gradient_checkpointing=True,
                                                 micro_batch_size=1, seq_len=512)
    slow = estimate(m, parse_hardware("2xRTX3090-24GB"), st).time["comm_seconds"]
    fast = estimate(m, parse_hardware("2xRTX3090-24GB"), st, profile=p.with_values(shm_bus_fraction=1.0)).time
    assert slow / fast["comm_seconds"] == pytest.approx(0.7 / 0.31, rel=0.05)


def test_dora_rebuilds_its_weight_norm_every_forward():
    """DoRA beyond LoRA (peft/tuners/lora/dora.py): per adapted linear k -> n and forward, 8k² + 34kn bytes
    (eye, B·A, the weight cast, scale, add, norm); per token 26n forward + 48n backward; 10 forward-only ops
    and 6 with a backward. Llama-3.2-1B, q (2048 -> 2048) and v (2048 -> 512), 256 tokens, no checkpointing."""
    m, hw = resolve_model("llama-3.2-1b"), parse_hardware("A100-80GB")
    base = dict(micro_batch_size=1, seq_len=256, lora_targets=("q_proj", "v_proj"), lora_dropout=0.0)
    lora = estimate(m, hw, Strategy(method="lora", **base)).time
    dora = estimate(m, hw, Strategy(method="dora", **base)).time
    g, p = gpu_rates(hw.gpu, "bf16-mixed", Profile()), Profile()
    k = 2048
    weight = (8 * k * k + 34 * k * 2048) + (8 * k * k + 34 * k * 512)  # 245.4 MB per layer
    token = 74.0 * (2048 + 512)  # 189,440 bytes per token and layer
    se = 2.0  # the residual stream's values (bf16-mixed LoRA: 16-bit)
    extra_mem = m.layers * (256 * token / g.bandwidth(256 * m.hidden * se) + weight / g.bandwidth(4.0 * k * 2048))
    assert dora["memory_bound_seconds"] - lora["memory_bound_seconds"] == pytest.approx(extra_mem, rel=1e-9)
    assert dora["dispatch_seconds"] - lora["dispatch_seconds"] == pytest.approx(
        m.layers * 2 * (10 * 0.4 + 6) * p.gpu_host_op_seconds, rel=1e-9)
