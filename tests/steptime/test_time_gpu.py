"""The time model on a calibrated GPU (a CUDA profile made by hand): what runs on the host beside the device."""

import pytest

from memfit.estimate import estimate
from memfit.steptime.loop import CLIP_FOREACH_OPS
from memfit.methods.base import weight_tensors
from memfit.spec import hwprofile
from memfit.spec.hardware import CATALOG, HardwareSpec
from memfit.spec.model import model_from_config
from memfit.spec.strategy import Strategy

# h=64, heads=4, kv_heads=2, f=128, L=2, V=100 (as tests/steptime/test_time_model.py)
TINY = model_from_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2,
                          "vocab_size": 100}, name="tiny")
# 2 x (q 4096 + k, v 2048 + o 4096 + gate, up, down 3 x 8192 + 2 norms x 64) + embedding and head 2 x 6400 + norm
PARAMS = 2 * (4096 + 2 * 2048 + 4096 + 3 * 8192 + 2 * 64) + 2 * 6400 + 64


def cuda_rates(per_param=1e-10, **kw):
    g = {"small": 1e13, "medium": 1e13, "large": 1e13, "skinny": 1e12,
         "widths": {"small": 512.0, "medium": 1536.0, "large": 4096.0}}
    base = dict(device="cuda", measured_at="2026-11-30", cores=16, gemm={"device": {"bf16": g}},
                attention={"device": {"sdpa": {"bf16": {"1024": 1e13, "4096": 1e13}}, "eager": {}}},
                bandwidth={"device": 1e12}, op_seconds=1e-5,
                # the 128-value figure must not be used on CUDA (foreach sweeps every tensor per kernel)
                optimizer={"device": {"per_param": per_param, "per_tensor": 1e-5, "tensor_params": 1 << 24,
                                      "per_param_mid": 1e-6, "mid_tensor_params": 128},
                           "cpu_torch": 1e-9, "cpu_deepspeed": None},
                overheads={"layer": 1e-3, "model": 2e-3, "adapter": 1e-4, "eager_layer_extra": 5e-4},
                fingerprint="gpu")
    base.update(kw)
    return hwprofile.HardwareRates(**base)


def pool(**kw):
    return HardwareSpec(CATALOG["H200-141GB"], label="local", rates=cuda_rates(**kw))


def test_optimizer_phase_is_the_longer_of_host_and_device():
    st = Strategy(method="full", seq_len=8, micro_batch_size=1, precision="bf16-mixed")
    tensors = weight_tensors(TINY)
    assert tensors == 2 * 9 + 2 + 1  # 7 linears + 2 norms per layer, embedding, final norm, untied head
    clip_bytes = PARAMS * 4.0 * 3.0 / 1e12  # the norm reads every fp32 gradient, the scale reads and writes it
    host = tensors * 1e-5 + CLIP_FOREACH_OPS * 1e-5  # AdamW's per-tensor Python + clipping's foreach ops
    t = estimate(TINY, pool(), st).time
    assert t["basis"].startswith("measured on this machine")
    assert t["optimizer_seconds"] == pytest.approx(host)  # device sweeps: 8.7 us < host 270 us
    slow = estimate(TINY, pool(per_param=1e-8), st).time
    assert slow["optimizer_seconds"] == pytest.approx(PARAMS * 1e-8 + clip_bytes)  # 870 us > host
    # micro-batches, then the optimizer phase: the parts still add up to the step
    parts = (t["compute_seconds"] + t["optimizer_seconds"] + t["trainer_seconds"] + t["comm_exposed_seconds"]
             + t["offload_seconds"] + t["upload_seconds"] + t["cpu_optimizer_seconds"] + t["meft_seconds"]
             + t["engine_seconds"])
    assert t["step_seconds"] == pytest.approx(parts)


def test_linear4bit_calls_are_host_work_on_a_gpu():
    st = Strategy(method="qlora", seq_len=8, micro_batch_size=1, precision="bf16-mixed")
    plain = estimate(TINY, pool(), st).time
    called = estimate(TINY, pool(dequant={"nf4": 1e12, "nf4_call_s": 5e-4}), st).time
    # 7 Linear4bit per layer x 2 layers x 0.5 ms join the dispatch (the host), not the device's dequant work
    assert called["dispatch_seconds"] - plain["dispatch_seconds"] == pytest.approx(14 * 5e-4)
    assert called["dequant_seconds"] < 1e-6
    # host-bound: the micro-batch is its dispatch
    assert called["compute_seconds"] == pytest.approx(called["dispatch_seconds"])
