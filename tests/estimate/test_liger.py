"""Liger Kernel (liger: true): what its RMSNorm, fused gate activation and fused linear cross-entropy save, by hand
(liger-kernel 0.8.5: ops/rms_norm.py save_for_backward(X, W, RSTD), in-place dX; ops/swiglu.py save_for_backward(a,
b), gradients written into a and b; ops/fused_linear_cross_entropy.py chunk = next_pow2(cdiv(BT, cdiv(V, H)))),
the flash-attn package's backward, the tiled MLP's relief, and the rules."""

import pytest

from memfit.estimate import activations as A
from memfit.estimate import estimate
from memfit.estimate.constants import Profile
from memfit.plan.rules import check
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy, liger_chunk_tokens

M = resolve_model("llama-3.1-8b")  # h 4096, q 4096, kv 1024, f 14336, 32 heads
H, Q, KV, F = 4096, 4096, 1024, 14336


def _parts(liger: bool, shards: int = 1, attention: str = "fa2"):
    return A.activation_parts(M, 1024, 1, 2.0, attention, True, Profile(), trained=True, liger=liger,
                              mlp_shards=shards)


def test_liger_layer_saves_by_hand():
    attention = 2 * (Q + 2 * KV) + 2 * Q + 4 * 32  # q, k, v, the output, fp32 log-sum-exp per head
    # transformers: each RMSNorm its fp32 input copy, the normalised value and its output; gate, act, up, product
    hf = 2 * ((4 + 2) * H + 2 * H) + attention + 2 * F * 4
    # Liger: each norm its input and a fp32 rstd (the first one's input is the checkpointed layer input itself),
    # its output; gate, up and the product
    liger = (2 * H + 4) + 2 * H + (2 * H + 4) + 2 * H + attention + 2 * F * 3 - 2 * H
    assert _parts(False)[1] == 1024 * hf
    assert _parts(True)[1] == 1024 * liger
    # the tail: the final norm's input and rstd (transformers: fp32 copy + normalised value), the head's input
    assert _parts(True)[2] == 1024 * ((2 * H + 4) + 2 * H)
    assert _parts(False)[2] == 1024 * ((4 + 2) * H + 2 * H)


def test_flash_backward_outweighs_liger_mlp_backward():
    flash = 2 * Q + 2 * (Q + 2 * KV) + 4 * Q + 4 * 32 + 2 * 2 * Q  # dout, dq dk dv, dq_accum, softmax_d, GQA
    assert _parts(True)[3] == 1024 * (2 * H + max(2 * F, flash))  # Liger's MLP backward: the product's gradient
    assert _parts(False)[3] == 1024 * (2 * H + max(2 * F * 2, flash))
    assert _parts(False, attention="sdpa")[3] == 1024 * (2 * H + 2 * F * 2)


def test_tiled_mlp_keeps_one_shard_of_the_mlp_including_the_product():
    shards = 4
    # the layer without its MLP saves (Liger's gate, up, product), with one shard of transformers' MLP's
    # (gate, act, up, product) instead: TiledMLP saves only its input
    assert _parts(True, shards)[1] == _parts(True)[1] - 1024 * 2 * F * 3 + 1024 * 2 * F * 4 / shards
    assert _parts(False, shards)[1] == _parts(False)[1] - 1024 * 2 * F * 4 * (1 - 1 / shards)
    # its backward: one shard's gradients (act's and up's) + the whole input's gradient it fills shard by shard
    # (ulysses_sp.py TiledMLP.backward: x_grad = torch.zeros_like(x)); SDPA, whose backward the MLP's outweighs
    assert _parts(False, shards, "sdpa")[3] == 1024 * (2 * H + 2 * F * 2 / shards + 2 * H)


def test_liger_chunked_logits_and_strategy():
    assert liger_chunk_tokens(128256, 4096, 131072) == 4096  # cdiv(V, H) = 32; next_pow2(131072 / 32)
    assert liger_chunk_tokens(32000, 4096, 16384) == 2048  # liger's own example: inc_factor 8, chunk 2048
    assert liger_chunk_tokens(128256, 4096, 100) == 4
    s = Strategy(method="full", zero_stage=3, liger=True, gradient_checkpointing=True, attention="fa2", seq_len=131072)
    assert s.loss == "chunked" and "liger" in s.label()
    e = estimate(M, parse_hardware("8xH100-80GB"), s).to_dict()["memory"]["gpu_bytes"]
    # Liger's fused path under ZeRO-3 too: one chunk of 16-bit logits + the hidden-state gradients + the head's
    assert e["logits"] == pytest.approx(4096 * 128256 * 2 + 131072 * H * 2 + 128256 * H * 2, rel=1e-9)
    with pytest.raises(ValueError, match="liger=true computes the loss with Liger's fused linear cross-entropy"):
        Strategy(liger=True, loss="standard")


def test_liger_rules():
    s = Strategy(method="full", liger=True)
    assert check(M, parse_hardware("2xcpu"), s) == [
        "liger=true: Liger Kernel's kernels are Triton kernels for GPUs; the CPU device cannot run them (estimate "
        "it for a GPU pool, or set liger=false)"]
    assert check(resolve_model("falcon-7b"), parse_hardware("H100-80GB"), s) == [
        "liger=true: Liger Kernel 0.8.5 patches no 'falcon' model (llama, mistral, mixtral, qwen2, qwen3, gemma, "
        "phi3, granite, ...); set liger=false"]
    assert check(M, parse_hardware("H100-80GB"), s) == []


def test_a_long_context_estimate_names_the_long_context_runs_it_was_checked_against(capsys):
    """An estimate that pulls a long-context lever carries bench/long_context.py's figures (development), beside
    the short-context error bar of its kind; one without a lever carries none."""
    import json as _json

    from memfit.estimate.accuracy import LONG_CONTEXT
    from tests.cli_helper import run_cli

    shipped = _json.loads(LONG_CONTEXT.read_text())
    hw = parse_hardware("8xH100-80GB")
    plain = Strategy(method="full", zero_stage=3, gradient_checkpointing=True, seq_len=4096)
    assert estimate(M, hw, plain).to_dict()["long_context_error"] is None
    lc = estimate(M, hw, plain.model_copy(update={"sequence_parallel": 8})).to_dict()["long_context_error"]
    assert lc == shipped and lc["basis"] == {"memory": "development", "time": "development"}
    code, out, _ = run_cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--method",
                           "full", "--zero", "3", "--gradient-checkpointing", "--seq-len", "65536", "--liger")
    flat = " ".join(out.split())
    mem = shipped["memory"]
    assert code == 0 and (f"long context published long-context runs (development): memory median |e| "
                          f"{mem['median_abs_pct']} % over {mem['compared']} figures") in flat
