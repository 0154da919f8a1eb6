"""The HF Trainer's own loop in the time model (bench/studies/trainer_overhead.py measures its constants)."""

import pytest

from memfit.estimate import Profile
from memfit.steptime.loop import trainer_loop_ops


def test_trainer_loop_by_step_micro_batch_and_adapter():
    p = Profile()
    out1, out4 = 58 + 29, 58 + 4 * 29  # the loop around the step: measured 80-97 and 151-205
    assert trainer_loop_ops(p, 1, 0) == pytest.approx(35 + 26 + out1)  # full fine-tuning: measured 61 + outside
    assert trainer_loop_ops(p, 4, 0) == pytest.approx(35 + 4 * 26 + out4)  # 4 micro-batches: measured 138 + outside
    # LoRA on 2 layers x 7 linears = 14 adapters: PEFT's wrappers + 1.7 per adapter per step, 5.2 per micro-batch
    assert trainer_loop_ops(p, 1, 14) == pytest.approx(35 + 26 + 30 + 14 * 6.9 + out1)  # measured 184 + outside
    assert trainer_loop_ops(p, 4, 14) == pytest.approx(35 + 4 * (26 + 14 * 5.2) + 30 + 14 * 1.7 + out4)  # 478
    assert trainer_loop_ops(p, 1, 42) == pytest.approx(35 + 26 + 30 + 42 * 6.9 + out1)  # 6 layers: measured 383
    zero = Profile(trainer_step_ops=0.0, trainer_micro_batch_ops=0.0, trainer_peft_ops=0.0,
                   trainer_adapter_step_ops=0.0, trainer_adapter_micro_batch_ops=0.0,
                   trainer_outside_step_ops=0.0, trainer_outside_micro_batch_ops=0.0)
    assert trainer_loop_ops(zero, 8, 100) == 0.0
