"""Long-context levers in the estimate (issue 36): sequence shards, the exchange buffers, offloaded activations,
the tiled MLP and their time, checked against hand-computed values (memfit/estimate/longctx.py)."""

import math

import pytest

from memfit.estimate import estimate
from memfit.estimate.pinned import pinned_block
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy

L8 = resolve_model("llama-3.1-8b")
H100 = parse_hardware("8xH100-80GB")
BASE = dict(method="full", zero_stage=3, gradient_checkpointing=True, attention="fa2", loss="chunked")


def test_sequence_parallelism_leaves_each_rank_its_share_plus_the_all_to_all_buffers():
    """Ulysses over 8: every layer, the loss and the saved tensors at seq_len / 8; one layer's working set holds
    the all-to-alls' input and output (q, k, v and the output; Llama-3.1-8B's 8 KV heads: no replication)."""
    s = 262144
    sp = estimate(L8, H100, Strategy(**BASE, seq_len=s, sequence_parallel=8))
    local = estimate(L8, H100, Strategy(**BASE, seq_len=s // 8))
    e, tokens = 2.0, s // 8
    exchange = 2.0 * tokens * (2 * L8.q_dim + 2 * L8.kv_dim) * e
    assert sp.gpu["logits"] == pytest.approx(local.gpu["logits"], rel=1e-12)
    assert sp.gpu["weights"] == local.gpu["weights"]
    # the exchange lives in one layer's backward working set: the peak phases that hold it grow by it
    assert sp.gpu["total"] - sp.gpu["overhead"] == pytest.approx(
        local.gpu["total"] - local.gpu["overhead"] + exchange, rel=1e-9)
    # tokens per step are the sequence's: 8 ranks x 32768 tokens = one sample of 262144
    assert sp.tokens_per_second * sp.step_seconds == pytest.approx(s, rel=1e-12)


def test_ulysses_time_attends_every_head_share_over_the_whole_sequence():
    s = 131072
    sp = estimate(L8, H100, Strategy(**BASE, seq_len=s, sequence_parallel=8)).time
    # attention FLOPs per rank: 4·b·s²·q_dim·L·(3 + recompute) / 8 (heads / 8 over the whole length)
    assert sp["attention_flops"] == pytest.approx(4.0 * s * s * L8.q_dim * L8.layers * 4.0 / 8, rel=1e-12)
    # four all-to-alls per layer and pass (forward, recompute, backward), each rank sending 7/8 of its buffer at
    # the H100's NVLink bus (the group sits in one node), + a launch latency per call
    from memfit.estimate.constants import DEFAULT_PROFILE as P
    per_token = L8.layers * 3.0 * (2 * L8.q_dim + 2 * L8.kv_dim) * 2.0
    bus = H100.gpu.intra_node_bandwidth * P.intra_node_efficiency
    expect = (s // 8) * per_token * 7 / 8 / bus + L8.layers * 3.0 * 4.0 * P.collective_latency_seconds
    assert sp["sequence_exchange_seconds"] == pytest.approx(expect, rel=1e-9)


def test_checkpointed_offload_moves_each_layer_input_to_pinned_host_blocks():
    s = 65536
    plain = estimate(L8, H100, Strategy(**BASE, seq_len=s))
    off = estimate(L8, H100, Strategy(**BASE, seq_len=s, activation_offload="checkpointed"))
    layer_input = s * L8.hidden * 2.0  # the residual stream in bf16 (ZeRO-3 keeps 16-bit weights: no autocast)
    assert off.cpu["offloaded_activations"] == 8 * L8.layers * pinned_block(layer_input)
    assert off.cpu["offloaded_activations"] == 8 * 32 * 2 ** 29  # 512 MiB each: a power of two already
    assert plain.gpu["activations"] - off.gpu["activations"] == pytest.approx(
        (L8.layers - 1) * layer_input, rel=1e-9)
    # the copies wait on the compute stream: device -> host in the forward, back in the backward, over PCIe
    from memfit.estimate.constants import DEFAULT_PROFILE as P
    pcie = H100.gpu.pcie_bandwidth * P.pcie_efficiency
    assert off.time["activation_copy_seconds"] == pytest.approx(2 * L8.layers * layer_input / pcie, rel=1e-9)
    assert off.step_seconds > plain.step_seconds


def test_tiled_mlp_saves_one_shard_and_runs_the_mlp_forward_once_more():
    s = 32768
    plain = estimate(L8, H100, Strategy(**BASE, seq_len=s))
    tiled = estimate(L8, H100, Strategy(**BASE, seq_len=s, tiled_mlp=True))
    assert tiled.gpu["activations"] < plain.gpu["activations"]
    shards = math.ceil(s / L8.hidden)
    assert shards == 8
    mlp = sum(x.in_features * x.out_features for x in L8.linears if x.name in ("gate_proj", "up_proj", "down_proj"))
    # one more forward of the MLP's linears per layer: 2·T·(k·n) FLOPs each
    assert tiled.time["dense_flops"] - plain.time["dense_flops"] == pytest.approx(2.0 * s * mlp * L8.layers,
                                                                                 rel=1e-12)


def test_context_parallelism_gathers_the_whole_sequence_keys_and_values():
    s = 131072
    st = Strategy(method="full", fsdp="full_shard", gradient_checkpointing=True, attention="sdpa", loss="chunked",
                  seq_len=s, context_parallel=8)
    cp = estimate(L8, H100, st)
    local = estimate(L8, H100, st.model_copy(update={"seq_len": s // 8, "context_parallel": 1}))
    gathered = 2.0 * 2.0 * s * L8.kv_dim * 2.0  # K and V of the whole sequence, and their gradients
    assert cp.gpu["total"] - cp.gpu["overhead"] == pytest.approx(
        local.gpu["total"] - local.gpu["overhead"] + gathered, rel=1e-9)
    assert cp.time["sequence_exchange_seconds"] > 0


def test_offload_all_also_packs_what_autograd_saves_outside_the_checkpoints():
    """save_on_cpu around the step packs the tail (final norm and head inputs), the head's W^T and the standard
    loss's fp32 logits twice besides the layers' inputs (what memfit train counts: tests/train/
    test_long_context_train.py), each in its own pinned block."""
    s = 8192
    st = dict(BASE, loss="standard", seq_len=s)
    ckpt = estimate(L8, H100, Strategy(**st, activation_offload="checkpointed"))
    every = estimate(L8, H100, Strategy(**st, activation_offload="all"))
    tail = every.gpu["activations"]  # the tail leaves the device: compare with the checkpointed run's
    assert tail < ckpt.gpu["activations"]
    head = L8.vocab * L8.hidden * 2.0
    logits = 4.0 * s * L8.vocab
    tail_part = 2 * s * L8.hidden * 4.0  # fp32 norm input and the trained head's input, 2 x 4 B x h per token
    extra = sum(pinned_block(x) for x in (tail_part / 2, tail_part / 2, head, logits, logits))
    assert every.cpu["offloaded_activations"] - ckpt.cpu["offloaded_activations"] == pytest.approx(8 * extra,
                                                                                                  rel=0.01)
