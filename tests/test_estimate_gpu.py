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
