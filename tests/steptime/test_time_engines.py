"""The sharded engines' time on a CPU: FSDP2's collectives per wrapped group, DeepSpeed's and FSDP2's host work
(memfit.steptime.engine_host), and the gloo calibration's mean per call (memfit.measure.collective_bench)."""

import pytest

from memfit.estimate import Profile, estimate
from memfit.steptime.engine_host import engine_host_seconds
from memfit.steptime.comm import collective_calls
from memfit.spec.hardware import parse_hardware
from memfit.spec.strategy import Strategy
from test_time_model import TINY, cpu_pool

FP32 = dict(method="full", seq_len=8, micro_batch_size=1, precision="fp32", attention="sdpa")


def test_fsdp2_collectives_one_per_wrapped_group():
    # accelerate wraps 4 layers + the input embedding + [final norm, lm_head]: 6 groups. full_shard: 6 gathers
    # forward, 5 again in backward (the tail keeps its weights), 6 reduce-scatters = 17 (a 2-rank gloo run of
    # the h-256 Llama: 11 + 6 per step); no byte buckets (FSDP2 issues one collective per group)
    assert collective_calls("zero3", 4, 3e7, 1, False, fsdp=True) == 17
    assert collective_calls("zero3", 4, 3e7, 2, False, fsdp=True) == 34  # per micro-batch (sync_each_batch)
    # under the HF Trainer's no_sync the reduce-scatters come once, at the last micro-batch (transformers
    # trainer.py enters accelerate's no_sync for every micro-batch but the last unless sync_each_batch)
    assert collective_calls("zero3", 4, 3e7, 2, False, fsdp=True, no_sync=True) == 2 * 11 + 6
    # checkpointing: FSDP2's recomputation runs after the pre-backward gather (counted: 6 + 5 gathers as without)
    assert collective_calls("zero3", 4, 3e7, 1, True, fsdp=True) == 17
    assert collective_calls("sgo", 4, 3e7, 1, False, fsdp=True) == 6 + 6  # gathered once per micro-batch
    # DeepSpeed ZeRO-3 keeps its byte buckets + per-layer gathers: ceil(3e7 / 25e6) + 4 x 3
    assert collective_calls("zero3", 4, 3e7, 1, False) == 2 + 12


def test_fsdp2_gathers_twice_per_micro_batch_with_or_without_checkpointing():
    from memfit.steptime.comm import comm_parts

    # 10 MB of weights, 1e6 trainable parameters of 4-byte gradients, 2 micro-batches
    assert comm_parts("zero3", 0, 1e7, 1e6, 4, 4, 2, True, fsdp=True) == {"all_gather": 2 * 2 * 1e7,
                                                                         "reduce_scatter": 2 * 4e6}
    # FSDP under the HF Trainer's no_sync reduce-scatters once per step; DeepSpeed ZeRO-3 every micro-batch
    assert comm_parts("zero3", 0, 1e7, 1e6, 4, 4, 2, True, fsdp=True, no_sync=True)["reduce_scatter"] == 4e6
    assert comm_parts("zero3", 0, 1e7, 1e6, 4, 4, 2, True) == {"all_gather": 2 * 3 * 1e7, "reduce_scatter": 2 * 4e6}


def test_deepspeed_zero12_host_work_by_hand():
    p = Profile()
    # 39 gradients, 3.4 M parameters of 4 bytes, 2 ranks, 2 micro-batches, 10 us per op, 1e10 B/s.
    # per reduction: 39 x 30 op costs x 1e-5 = 11.7 ms + (6 + 2/2) x 13.6 MB / 1e10 = 9.52 ms -> 21.22 ms;
    # at the step: 39 x 35 x 1e-5 = 13.65 ms
    z2 = engine_host_seconds("zero2", False, 39, 39, 3.4e6, 4.0, 0.0, 2, 2, 1e-5, 1e10, p)
    assert z2 == pytest.approx(2 * 21.22e-3 + 13.65e-3)
    z1 = engine_host_seconds("zero1", False, 39, 39, 3.4e6, 4.0, 0.0, 2, 2, 1e-5, 1e10, p)
    assert z1 == pytest.approx(21.22e-3 + 13.65e-3)  # ZeRO-1 reduces once, at the step
    assert engine_host_seconds("zero2", False, 39, 39, 3.4e6, 4.0, 0.0, 1, 2, 1e-5, 1e10, p) == 0.0
    assert engine_host_seconds("ddp", False, 39, 39, 3.4e6, 4.0, 0.0, 2, 2, 1e-5, 1e10, p) == 0.0


def test_fsdp2_host_work_by_hand():
    p = Profile()
    # hooks: 39 parameters x 83 x 1e-5 = 32.37 ms; copies: 2 gathers x 13.6 MB x (2 + 2/2) = 81.6 MB + the
    # gradients 13.6 MB x 3 = 40.8 MB -> 122.4 MB / 1e10 = 12.24 ms; the optimizer over 39 DTensors:
    # 39 x 9.4 ops x 4.0 x 1e-5 = 14.664 ms
    full = engine_host_seconds("zero3", True, 39, 39, 3.4e6, 4.0, 13.6e6, 2, 1, 1e-5, 1e10, p)
    assert full == pytest.approx(32.37e-3 + 12.24e-3 + 14.664e-3)
    # LoRA: the hooks still visit all 39 parameters, 8 adapter tensors train (0.1 M parameters)
    lora = engine_host_seconds("zero3", True, 8, 39, 1e5, 4.0, 13.6e6, 2, 1, 1e-5, 1e10, p)
    assert lora == pytest.approx(32.37e-3 + (81.6e6 + 1.2e6) / 1e10 + 8 * 9.4 * 4.0e-5)
    # shard_grad_op gathers once per micro-batch: 13.6 MB x 3 less
    sgo = engine_host_seconds("sgo", True, 39, 39, 3.4e6, 4.0, 13.6e6, 2, 1, 1e-5, 1e10, p)
    assert full - sgo == pytest.approx(40.8e6 / 1e10)


def test_estimate_adds_engine_host_work_on_a_cpu_only(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 processes x 1 thread on 2 cores (.ci/run exports 2)
    ddp = estimate(TINY, cpu_pool(2), Strategy(**FP32)).time
    z2 = estimate(TINY, cpu_pool(2), Strategy(**FP32, zero_stage=2)).time
    fsdp = estimate(TINY, cpu_pool(2), Strategy(**FP32, fsdp="full_shard")).time
    assert ddp["engine_seconds"] == 0.0 and z2["engine_seconds"] > 0.0 and fsdp["engine_seconds"] > 0.0
    for t in (z2, fsdp):
        parts = (t["compute_seconds"] + t["optimizer_seconds"] + t["trainer_seconds"] + t["comm_exposed_seconds"]
                 + t["engine_seconds"])
        assert t["step_seconds"] == pytest.approx(parts)
    # TINY (21 tensors) trains under FSDP2 a shard of every tensor: AdamW's per-tensor cost (the profile's
    # per_tensor, 1e-5) and clipping's 2 ops per tensor (1e-5 each) count 21 tensors, not the 10.5 of
    # DeepSpeed's partition
    assert fsdp["optimizer_seconds"] - z2["optimizer_seconds"] == pytest.approx(21 / 2 * (1e-5 + 2e-5))
    gpu = estimate(TINY, parse_hardware("2xA100-80GB"), Strategy(**FP32, zero_stage=2)).time
    # on a GPU the gradient hooks run beside the device's kernels (in the micro-batch's host time); DeepSpeed's
    # step bookkeeping (35 small ops per trainable tensor, 21 here) is the step's own: it waits for it
    assert gpu["engine_seconds"] == pytest.approx(21 * 35 * 1.2e-5)


def test_gloo_calibration_times_the_mean_call(monkeypatch):
    from memfit.measure import collective_bench as cb

    clock = [0.0]
    # a warm-up call, then 8 calls alternating 0.5 / 3.5 ms, and one call preempted for 200 ms
    slow = iter([1.0] + [0.5e-3, 3.5e-3] * 4 + [0.2])

    def call() -> None:
        clock[0] += next(slow)
    monkeypatch.setattr(cb.time, "perf_counter", lambda: clock[0])
    # the step pays the sum of its calls: the mean of the 8 (the 200 ms call, over 20 x the median 3.5 ms,
    # left out) is 2.0 ms, where their median would say anything from 0.5 to 3.5
    assert cb.mean_call_seconds(call, 9) == pytest.approx(2.0e-3)
    slow = iter([1.0] + [0.5e-3, 3.5e-3] * 4 + [0.05])  # 50 ms < 20 x 3.5 ms: kept
    assert cb.mean_call_seconds(call, 9) == pytest.approx((16e-3 + 0.05) / 9)


def test_fsdp2_copies_around_its_collectives_and_fsdp1_none():
    from memfit.steptime.comm import fsdp2_copy_bytes

    # full_shard, 1 GB gathered per all-gather over 4 GPUs, 0.5e9 trainable values with bf16 gradients reduced
    # in fp32 (2 + 4 bytes), 2 micro-batches: 2 x (2 gathers x (2 x 0.25 GB copy-in + 2 x 1 GB copy-out) + 3 GB)
    assert fsdp2_copy_bytes("zero3", 1e9, 4, 0.5e9, 4.0, 2.0, 2) == pytest.approx(2 * (2 * 2.5e9 + 3e9))
    # under no_sync the reduce-scatter's copy-in comes once per step
    assert fsdp2_copy_bytes("zero3", 1e9, 4, 0.5e9, 4.0, 2.0, 2, no_sync=True) == pytest.approx(2 * 2 * 2.5e9 + 3e9)
    assert fsdp2_copy_bytes("sgo", 1e9, 4, 0.0, 4.0, 2.0, 1) == pytest.approx(2.5e9)  # one gather per micro-batch
    # on 8 A100s, FSDP2's step costs exactly its copies more than FSDP1's
    from memfit.spec.model import resolve_model

    m, hw = resolve_model("llama-2-7b"), parse_hardware("8xA100-80GB")
    t1, t2 = (estimate(m, hw, Strategy(method="full", fsdp="full_shard", fsdp_version=v, seq_len=2048,
                                       gradient_checkpointing=True)).time for v in (1, 2))
    assert t1["fsdp_copy_seconds"] == 0.0 < t2["fsdp_copy_seconds"]
    assert t2["step_seconds"] - t1["step_seconds"] == pytest.approx(t2["fsdp_copy_seconds"], rel=0.05)
