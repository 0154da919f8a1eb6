"""loss=chunked in the estimator, the planner and the CLI (plain Python, no torch)."""

import json

import pytest

from memfit.estimate import estimate
from memfit.plan.search import plan
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import LOSS_CHUNK_TOKENS, Strategy, loss_chunk_tokens
from cli_helper import run_cli

LLAMA3 = resolve_model("llama-3.1-8b")  # vocab 128,256, hidden 4,096
RTX4090 = parse_hardware("1xRTX4090-24GB")


def test_chunk_is_256_tokens_or_the_whole_micro_batch():
    assert LOSS_CHUNK_TOKENS == 256
    assert loss_chunk_tokens(128256, 8192) == 256 and loss_chunk_tokens(50257, 100) == 100


def test_logits_line_is_one_chunk_by_hand():
    kw = dict(method="lora", gradient_checkpointing=True, seq_len=8192, micro_batch_size=1)
    std = estimate(LLAMA3, RTX4090, Strategy(**kw))
    chk = estimate(LLAMA3, RTX4090, Strategy(**kw, loss="chunked"))
    # 12 bytes per logit at the loss peak (fp32 log-softmax + two fp32 gradients; Profile.logits_bytes_16bit)
    assert std.gpu["logits"] == 8192 * 128256 * 12 == 12_608_077_824
    # one chunk of 256 tokens at 8 B per logit (the fused loss: the chunk's fp32 logits, turned into softmax and
    # gradient in place, + logsumexp's temporary; Profile.chunked_logits_bytes), + the hidden-state gradients
    # the loss makes in the forward (bf16 under LoRA: 2 B x tokens x hidden)
    assert chk.gpu["logits"] == 256 * 128256 * 8 + 8192 * 4096 * 2 == 329_777_152
    # everything else is the same; the total drops by what the logits phase held
    for line in ("weights", "gradients", "optimizer", "lora_intermediates"):
        assert chk.gpu[line] == std.gpu[line]
    assert chk.gpu_total < std.gpu_total - 8e9
    # time: nothing is recomputed (the head's gradient matmuls run in the forward instead of the backward):
    # the same FLOPs and the same passes over the logits as the standard loss
    assert chk.time["dense_flops"] == std.time["dense_flops"]
    assert chk.step_seconds == pytest.approx(std.step_seconds, rel=1e-9)
    # under DeepSpeed ZeRO-3 the loss recomputes each chunk's logits in backward: one more head forward
    z3 = dict(kw, zero_stage=3)
    z3_std = estimate(LLAMA3, RTX4090, Strategy(**z3))
    z3_chk = estimate(LLAMA3, RTX4090, Strategy(**z3, loss="chunked"))
    assert z3_chk.time["dense_flops"] - z3_std.time["dense_flops"] == pytest.approx(2 * 8192 * 128256 * 4096)


def test_full_fine_tuning_holds_the_head_gradient_from_forward_to_backward():
    """The fused loss accumulates the head weight's gradient over the chunks in the forward and keeps it
    until backward; under ZeRO-3 (the recomputing path) it is made in backward as with the standard loss."""
    kw = dict(method="full", gradient_checkpointing=True, seq_len=4096, micro_batch_size=1, loss="chunked")
    ddp = estimate(LLAMA3, RTX4090, Strategy(**kw))  # bf16-mixed: fp32 weights, fp32 hidden states, fp32 grad
    assert ddp.gpu["logits"] == 256 * 128256 * 8 + 4096 * 4096 * 4 + 128256 * 4096 * 4 == 2_431_123_456
    z2 = estimate(LLAMA3, RTX4090, Strategy(**kw, zero_stage=2))  # 16-bit module weights and grads
    assert z2.gpu["logits"] == 256 * 128256 * 8 + 4096 * 4096 * 2 + 128256 * 4096 * 2
    # ZeRO-3: the recomputing path, 12 B per logit of the recomputed chunk (logits, log-softmax, 2 gradients)
    z3 = estimate(LLAMA3, RTX4090, Strategy(**kw, zero_stage=3))
    assert z3.gpu["logits"] == 256 * 128256 * 12 + 4096 * 4096 * 2


def test_short_micro_batch_is_one_chunk():
    kw = dict(method="lora", seq_len=64, micro_batch_size=2)
    chk = estimate(LLAMA3, RTX4090, Strategy(**kw, loss="chunked"))
    std = estimate(LLAMA3, RTX4090, Strategy(**kw))
    assert std.gpu["logits"] == 128 * 128256 * 12
    assert chk.gpu["logits"] == 128 * 128256 * 8 + 128 * 4096 * 2


DDP = {"zero_stage": 0, "fsdp": False, "offload": "none"}  # one GPU, nothing sharded or offloaded


def test_plan_says_when_the_chunked_loss_makes_it_fit():
    p = plan(LLAMA3, RTX4090, seq_len=8192, micro_batch_size=1, fixed=DDP)
    assert p.recommended.strategy.loss == "chunked"
    note = [w for w in p.why if "(--loss chunked) is what makes it fit" in w]
    # QLoRA + checkpointing + the chunked loss: 21.2 GB the card must hold; the standard loss needs 31.5 GB. (LoRA
    # needs 25.5 GB since #39: its cached layer working sets sit in split segments no retry releases)
    assert p.recommended.strategy.method == "qlora", p.why
    assert len(note) == 1 and "12.6 GB to 0.4 GB at the same step time" in note[0], p.why
    held = plan(LLAMA3, RTX4090, seq_len=8192, micro_batch_size=1, fixed={**DDP, "loss": "standard"})
    assert held.recommended is None or held.recommended.step_seconds > p.recommended.step_seconds


def test_plan_prefers_the_standard_loss_when_both_fit():
    p = plan(LLAMA3, RTX4090, seq_len=512, micro_batch_size=1)
    assert p.recommended.strategy.loss == "standard"
    assert not any("--loss chunked" in w for w in p.why)


_run = run_cli


def test_cli_loss_flag_and_json(capsys):
    code, out, _ = _run(capsys, "estimate", "-m", "llama-3.1-8b", "--gpus", "1xRTX4090-24GB", "--method", "lora",
                        "--seq-len", "4096", "--loss", "chunked", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["strategy"]["loss"] == "chunked"
    assert d["memory"]["gpu_bytes"]["logits"] == 256 * 128256 * 8 + 4096 * 4096 * 2
    code, out, err = _run(capsys, "estimate", "-m", "llama-3.1-8b", "--gpus", "1xRTX4090-24GB", "--loss", "fused")
    assert code == 2 and err.startswith("error: ") and "loss (--loss)" in err and "'chunked'" in err, err
