"""The CUDA side of the estimator, pinned to hand-computed bytes (issue 9)."""

from memfit.estimate import Profile, estimate
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy

A100 = parse_hardware("1xA100-80GB")


def test_foreach_adamw_step_allocates_one_state_sized_sqrt():
    # torch AdamW's foreach step (torch/optim/adam.py:762) allocates exp_avg_sq_sqrt: one state-sized
    # tensor per param. Pure bf16 full fine-tuning: states in bf16 -> 2 B per param; fp32 LoRA adapters: 4 B.
    m = resolve_model("mistral-7b")
    P = m.parameters
    assert P == 7_241_732_096
    est = estimate(m, A100, Strategy(method="full", precision="bf16", gradient_checkpointing=True, seq_len=4096,
                                     micro_batch_size=4, attention="fa2"))
    assert est.gpu["step_temporaries"] == 2 * P
    # the step is the peak: weights 2P + grads 2P + AdamW states 4P + the sqrt 2P (fms-acceleration measured
    # 72.43 GB allocated for this run at batch 4 and at batch 8)
    assert est.gpu["total"] - est.gpu["overhead"] == 10 * P
    fused = estimate(m, A100, est.strategy, profile=Profile(adamw_foreach_temp_copies=0.0))
    assert fused.gpu["step_temporaries"] == 0
    lora = estimate(m, A100, Strategy(method="lora", lora_targets=("q_proj", "v_proj"), lora_r=8))
    p_t = 32 * 8 * ((4096 + 4096) + (4096 + 1024))
    assert lora.trainable_parameters == p_t and lora.gpu["step_temporaries"] == 4 * p_t
    # DeepSpeed steps with its own fused Adam: no sqrt temporary
    z = estimate(m, parse_hardware("8xA100-80GB"), Strategy(method="full", zero_stage=3))
    assert z.gpu["step_temporaries"] == 4 * P / 8  # only its fp32 copy of the 16-bit gradient partition


def test_qlora_after_prepare_model_for_kbit_training_runs_an_fp32_stream():
    # fp32 embeddings/norms (peft/utils/other.py:205-209): the residual stream is fp32 and Linear4bit casts
    # its output back to the input dtype (bitsandbytes/nn/modules.py:637), so MLP values are fp32 too
    from memfit.estimate import activations as A
    from memfit.estimate.constants import DEFAULT_PROFILE as P
    m = resolve_model("mistral-7b")
    kw = dict(s=1024, b=1, e=2.0, attention="fa2", checkpointing=True, profile=P, method="qlora", shares=False)
    bf16 = A.activation_parts(m, **kw)
    fp32 = A.activation_parts(m, **kw, fp32_stream=True)
    # checkpointed layer inputs: 32 layers x 4 B x 1024 x 4096 (2 B in a 16-bit stream)
    assert fp32[0] == 32 * 4 * 1024 * 4096 and bf16[0] == 32 * 2 * 1024 * 4096
    # the recomputed layer: SwiGLU gate, act, up in fp32 (+2 B x 3 x 14336 per token); the layer input is
    # now the first norm's fp32 copy itself (-4 B x 4096)
    assert fp32[1] - bf16[1] == 1024 * (2 * 3 * 14336 - 4 * 4096)
    # one layer's backward: fp32 residual gradient (+2 B x 4096) and fp32 MLP gradients: the product's, act's
    # and up's, as down_proj (Linear4bit) never saved the product (bitsandbytes autograd/_functions.py:357)
    assert fp32[3] - bf16[3] == 1024 * (2 * 4096 + 2 * 3 * 14336)


def test_qlora_fp32_head_keeps_its_16bit_autocast_copy():
    m = resolve_model("mistral-7b")
    st = Strategy(method="qlora", gradient_checkpointing=True, seq_len=1024, attention="fa2")
    on = estimate(m, A100, st)
    off = estimate(m, A100, st, profile=Profile(qlora_fp32_upcast=0.0))
    # weights: embeddings, head and norms in fp32 instead of bf16: +2 B x (2 x 32000 x 4096 + 65 x 4096)
    assert on.gpu["weights"] - off.gpu["weights"] == 2 * (2 * 32000 * 4096 + 65 * 4096)
    # the head's bf16 weight copy (32000 x 4096 x 2 B) is saved from its forward to its backward
    assert on.gpu["activations"] > off.gpu["activations"] + 32000 * 4096 * 2
