"""The time model (memfit.steptime.step / speeds) at measured rates (the profile's life cycle:
tests/steptime/test_time_calibration.py)."""

import json

import pytest

from memfit.estimate import Profile, estimate
from memfit.spec import hwprofile
from memfit.spec.hardware import HardwareSpec, cpu_device, parse_hardware
from memfit.spec.model import model_from_config
from memfit.spec.strategy import Strategy

# h=64, heads=4 (head_dim 16), kv_heads=2 (kv_dim 32), f=128, L=2, V=100 (as tests/estimate/test_estimate_breakdown.py)
TINY = model_from_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2,
                          "vocab_size": 100}, name="tiny")
BASE = dict(method="full", seq_len=8, micro_batch_size=1, precision="bf16-mixed", attention="sdpa")
# one layer's linears: q 64x64 + k, v 64x32 + o 64x64 + gate, up, down 64x128 -> sum k*n = 36,864
LAYER_KN = 36_864


def rates(**kw):
    """A hand-made CPU profile: every GEMM 1e10 FLOP/s, SDPA 5e9 (eager 5e9 at s=4 falling to 1.25e9 at
    s=16), 1e10 B/s, 10 us per op."""
    g = {"small": 1e10, "large": 1e10, "skinny": 1e9, "widths": {"small": 128.0, "large": 1024.0}}
    base = dict(device="cpu", measured_at="2026-11-30", cores=2, gemm={"1": {"fp32": g}, "2": {"fp32": g}},
                attention={k: {"eager": {"fp32": {"4": 5e9, "16": 1.25e9}}, "sdpa": {"fp32": {"4": 5e9, "16": 5e9}}}
                           for k in ("1", "2")},
                bandwidth={"1": 1e10, "2": 1e10}, op_seconds=1e-5,
                optimizer={"1": {"per_param": 1e-9, "per_tensor": 1e-5}, "2": {"per_param": 1e-9, "per_tensor": 1e-5},
                           "cpu_torch": 1e-9, "cpu_deepspeed": None},
                collectives={"2": {"backend": "gloo", "bus_bytes_per_s": 1e9, "latency_s": 1e-4}},
                overheads={"layer": 1e-3, "model": 2e-3, "adapter": 1e-4, "eager_layer_extra": 5e-4},
                fingerprint="abc")
    base.update(kw)
    return hwprofile.HardwareRates(**base)


def cpu_pool(n=1, **kw):
    return HardwareSpec(cpu_device(), gpus_per_node=n, label="local", rates=rates(**kw))


def test_measured_rates_by_hand(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    st = Strategy(**{**BASE, "method": "lora", "precision": "fp32"})
    t = estimate(TINY, cpu_pool(), st).time
    assert t["basis"] == "measured on this machine 2026-11-30"
    # LoRA: frozen linears forward + input gradient (4 FLOPs per k*n and token), head likewise, at 1e10
    dense = 2 * 8 * LAYER_KN * 2 * 2 + 2 * 8 * 64 * 100 * 2
    # adapters r=16 on all 7 linears: sum (k + n) = 128+96+96+128+192+192+192 = 1024; 6 FLOPs x r x (k+n)
    adapter = 2 * 8 * 16 * 1024 * 3 * 2
    assert t["adapter_flops"] == adapter
    # every linear of TINY has a side <= 64: the skinny class (1e9), like the rank-16 adapters
    assert t["matmul_seconds"] == pytest.approx((dense + adapter) / 1e9)
    # dispatch as measured: per layer 1 ms + 7 adapters x 0.1 ms, + 2 ms for the rest of the model
    assert t["dispatch_seconds"] == pytest.approx(2 * (1e-3 + 7 * 1e-4) + 2e-3)
    # the Trainer's loop: 35 per step + 26 per micro-batch + PEFT's 30 + 14 adapted linears x (1.7 + 5.2) op costs
    assert t["trainer_seconds"] == pytest.approx((35 + 26 + 30 + 14 * 6.9 + 58 + 29) * 1e-5)
    # eager attention: its rate at s=8, log-interpolated between s=4 and 16 (sqrt(5e9 x 1.25e9) = 2.5e9),
    # and the extra dispatch per layer
    e = estimate(TINY, cpu_pool(), st.model_copy(update={"attention": "eager"})).time
    assert e["attention_seconds"] == pytest.approx(2 * t["attention_seconds"])
    assert e["dispatch_seconds"] - t["dispatch_seconds"] == pytest.approx(2 * 5e-4)


def test_lora_elementwise_bytes_from_peft_forward(monkeypatch):
    from memfit.steptime.work import lora_elementwise_bytes

    # fp32, no dropout: forward scale (2n) + add (3n); backward scale grad (2n) + x's two grads summed (3k)
    assert lora_elementwise_bytes(64, 128, 4.0, False, False, False) == 4 * (7 * 128 + 3 * 64)
    # + the recomputed forward under checkpointing
    assert lora_elementwise_bytes(64, 128, 4.0, False, False, True) == 4 * (12 * 128 + 3 * 64)
    # bf16 base: the input cast to fp32 adapters (2 + 4 bytes per input value) each way; dropout 4k + 3k passes
    assert lora_elementwise_bytes(64, 128, 2.0, True, True, False) == 2 * (7 * 128 + 3 * 64) + 2 * 6 * 64 + 2 * 7 * 64
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    st = Strategy(**{**BASE, "method": "lora", "precision": "fp32", "lora_dropout": 0.0})
    lora = estimate(TINY, cpu_pool(), st).time
    full = estimate(TINY, cpu_pool(), st.model_copy(update={"method": "full"})).time
    per_token = sum(lora_elementwise_bytes(k, n, 4.0, False, False, False)
                    for k, n in ((64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)))
    # LoRA's memory-bound work = full's less the embedding's dense gradient (2 x 4 B x V x h) + the adapters'
    assert lora["memory_bound_seconds"] - full["memory_bound_seconds"] == pytest.approx(
        (8 * 2 * per_token - 2 * 4 * 100 * 64) / 1e10)


def test_eager_in_two_parts_and_measured_checkpointing(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    st = Strategy(**{**BASE, "method": "full", "precision": "fp32", "attention": "eager", "seq_len": 16})
    parts = {"bmm": 4e9, "scores": {"1024": 4e-9, "16384": 1e-9}, "scores_forward_share": 0.6}
    att = {"1": {"eager": {"fp32": {"4": 5e9}}, "sdpa": {"fp32": {"4": 5e9}}, "eager_parts": {"fp32": parts}}}
    t = estimate(TINY, cpu_pool(attention=att), st).time
    # products: 12·b·s²·(H·d) per layer at 4e9; scores: b·H·s² = 1,024 values of 4 B = 4 kB, log-midway
    # between 1 kB (4 ns per value) and 16 kB (1 ns) -> 2 ns per value
    products, scores = 12 * 16 * 16 * 64 * 2 / 4e9, 2 * 1024 * 2e-9
    assert t["attention_seconds"] == pytest.approx(products + scores)
    # checkpointing recomputes the forward: a third of the products, the scores' measured forward share
    gc = estimate(TINY, cpu_pool(attention=att), st.model_copy(update={"gradient_checkpointing": True})).time
    assert gc["attention_seconds"] == pytest.approx(products * 4 / 3 + scores * 1.6)
    # SDPA under checkpointing: its measured forward share
    att["1"]["forward_share"] = {"sdpa": 0.25}
    sd = st.model_copy(update={"attention": "sdpa", "gradient_checkpointing": True})
    assert estimate(TINY, cpu_pool(attention=att), sd).time["attention_seconds"] == pytest.approx(
        12 * 16 * 16 * 64 * 2 / 5e9 * 1.25)
    # checkpointing's dispatch as measured (0.4 ms per layer over the plain layer's)
    o = {"layer": 1e-3, "model": 2e-3, "adapter": 1e-4, "eager_layer_extra": 0.0, "gc_layer_extra": 4e-4}
    assert estimate(TINY, cpu_pool(overheads=o), sd).time["dispatch_seconds"] == pytest.approx(2 * 1.4e-3 + 2e-3)


def test_deepspeed_zero12_all_reduce_their_buckets():
    from memfit.steptime.comm import comm_parts

    # stage_1_and_2.py average_tensor: all-reduce per bucket (use_multi_rank_bucket_allreduce=True), then the
    # all-gather of the updated fp32->16-bit params at the step
    assert sum(comm_parts("zero1", 0, 0, 1e6, 2, 2, ga=4, checkpointing=False).values()) == 2 * 1e6 * 2 + 1e6 * 2
    assert sum(comm_parts("zero2", 0, 0, 1e6, 2, 2, ga=4, checkpointing=False).values()) == 4 * 2 * 1e6 * 2 + 1e6 * 2


def test_processes_share_the_cores(monkeypatch):
    st = Strategy(**{**BASE, "precision": "fp32"})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = estimate(TINY, cpu_pool(1), st).time
    two = estimate(TINY, cpu_pool(2), st).time  # 2 processes x 1 thread on 2 cores: nobody waits
    assert two["matmul_seconds"] == pytest.approx(one["matmul_seconds"])
    # ... but one memory system: the 2-thread bandwidth (1e10 here, as at 1 thread) is split between them
    assert two["memory_bound_seconds"] == pytest.approx(2 * one["memory_bound_seconds"])
    # DDP all-reduce of the fp32 gradients: 2 x 86,848 x 4 B, half of it crosses, at the measured 1 GB/s
    # bus + 1 call x 0.1 ms latency; gloo on CPU: nothing hidden
    assert two["comm_seconds"] == pytest.approx(2 * 86_848 * 4 * 0.5 / 1e9 + 1e-4)
    assert two["comm_exposed_seconds"] == two["comm_seconds"]
    # the Trainer's own gathers (loss, flos, token counts: 4 per step) at the measured 0.1 ms latency
    assert two["trainer_seconds"] - one["trainer_seconds"] == pytest.approx(4 * 1e-4)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # 2 x 2 threads on 2 cores: each gets half
    crowded = estimate(TINY, cpu_pool(2), st).time
    assert crowded["matmul_seconds"] == pytest.approx(2 * one["matmul_seconds"])


def test_collectives_by_primitive(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    st = Strategy(**{**BASE, "precision": "fp32", "fsdp": "full_shard"})
    coll = {"2": {"backend": "gloo", "bus_bytes_per_s": 1e9, "latency_s": 0.0,
                  "all_gather": {"bus_bytes_per_s": 2e8, "latency_s": 0.0},
                  "reduce_scatter": {"bus_bytes_per_s": 1e8, "latency_s": 0.0}}}
    t = estimate(TINY, cpu_pool(2, collectives=coll), st).time
    # FSDP full_shard, fp32: gather the 86,848 weights in forward and backward, reduce-scatter the grads;
    # half of each crosses between 2 ranks, at the primitive's own bus bandwidth
    w = 86_848 * 4
    assert t["comm_seconds"] == pytest.approx(2 * w * 0.5 / 2e8 + w * 0.5 / 1e8)


def test_plan_batch_picks_the_fastest_micro_batch():
    from memfit.plan.batch import micro_batches, plan_batch
    from memfit.plan.search import plan

    assert micro_batches(6) == [1, 2, 3, 6]
    hw = parse_hardware("A100-80GB")
    best = plan_batch(TINY, hw, seq_len=256, sequences=8, methods=["lora"])
    rec = best.recommended.strategy
    assert rec.micro_batch_size * rec.grad_accum == 8
    for b in (1, 2, 4, 8):  # every option trains the same tokens per step; none is faster
        p = plan(TINY, hw, seq_len=256, micro_batch_size=b, grad_accum=8 // b, methods=["lora"])
        assert p.recommended.tokens_per_second <= best.recommended.tokens_per_second
    assert {c.strategy.micro_batch_size for c in best.candidates} == {1, 2, 4, 8}
    assert "micro-batch" in best.why[0]


def test_adamw_per_parameter_by_tensor_size():
    from memfit.steptime.speeds import Speeds

    sp = Speeds(basis="", gemm_small=1, gemm_large=1, width_small=1, width_large=1, gemm_skinny=1, attention=((1, 1),),
                bandwidth=1, op_seconds=0, overlap_dispatch=False, adam_per_param=6e-9, adam_per_tensor=0,
                cpu_adam_per_param=0, bus_bandwidth=1, collective_latency=0, h2d=1, d2h=1, dequant=1, peak=1,
                adam_mid=(1 << 17, 4e-9), adam_size=float(1 << 21))
    assert sp.adam_seconds_per_param(1 << 17) == pytest.approx(4e-9)  # cache-sized tensors
    assert sp.adam_seconds_per_param(1 << 19) == pytest.approx(5e-9)  # log-midway between 128k and 2M
    assert sp.adam_seconds_per_param(1 << 24) == pytest.approx(6e-9)  # large ones: clamped
    assert sp.adam_seconds_per_param(10) == pytest.approx(4e-9)


def test_page_faults_of_tensors_above_the_mmap_threshold(monkeypatch):
    from memfit.steptime.cpu import fresh_bytes, mmap_threshold

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert mmap_threshold() == 32 << 20  # glibc's dynamic threshold settles at its 64-bit ceiling
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert mmap_threshold() == 65536
    # eager, b=1, H=8, s=1024, fp32: 32 MiB score matrices; per layer 4 forward (matmul, scale, mask add,
    # fp32 softmax) + 3 gradients, + the 4 forward ones again under checkpointing; logits 1024 x 2048 x 4 B
    # (8 MiB) and the MLP's 1024 x 688 x 4 B stay under 32 MiB
    args = dict(b=1, s=1024, heads=8, vocab=2048, ff=688, layers=4, e=4.0, eager=True, chunked_loss=False,
                threshold=32 << 20)
    assert fresh_bytes(gc=False, **args) == 4 * 7 * (32 << 20)
    assert fresh_bytes(gc=True, **args) == 4 * 11 * (32 << 20)
    assert fresh_bytes(gc=False, **{**args, "eager": False}) == 0.0
    # the time model adds them at the measured first-touch cost, on CPU pools only
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1024")  # TINY's 8-token tensors: every 100-wide logits row counts
    st = Strategy(**{**BASE, "precision": "fp32"})
    plain = estimate(TINY, cpu_pool(), st).time
    bw = {"1": 1e10, "2": 1e10, "first_touch_s_per_byte": 1e-9}
    touched = estimate(TINY, cpu_pool(bandwidth=bw), st).time
    logits = 8 * 100 * 4  # 3,200 B >= 1,024: the head output and its gradient (e = 4) + 3 fp32 ones
    mlp = 8 * 128 * 4  # 4,096 B: 8 per layer
    assert touched["memory_bound_seconds"] - plain["memory_bound_seconds"] == pytest.approx(
        (5 * logits + 2 * 8 * mlp) * 1e-9)


def test_deepspeed_zero12_all_reduce_calls_per_bucket_or_parameter():
    from memfit.steptime.comm import collective_calls

    # 39 tensors, 3.4M parameters, reduce bucket h² = 65,536 elements: one all-reduce per parameter
    # (min(39, 52)) per micro-batch under ZeRO-2, + the parameters' all-gather at the step
    assert collective_calls("zero2", 4, 1e7, 2, False, tensors=39, p_t=3.4e6, reduce_bucket=65_536) == 2 * 39 + 1
    assert collective_calls("zero1", 4, 1e7, 2, False, tensors=39, p_t=3.4e6, reduce_bucket=65_536) == 39 + 1
    # many small tensors and a large bucket: one per bucket
    assert collective_calls("zero2", 4, 1e7, 1, False, tensors=500, p_t=3.4e6, reduce_bucket=1e6) == 4 + 1


def test_qlora_fp32_stream_moves_4_byte_values_and_casts_around_each_linear4bit():
    from memfit.steptime.work import elementwise_bytes, kbit_cast_bytes

    # TINY's linears: sum (in + out) = 128 + 96 + 96 + 128 + 192 + 192 + 192 = 1,024 values; bf16: 6 B each
    assert kbit_cast_bytes(TINY, 2.0) == 6 * 1024
    from memfit.steptime.rates import gpu_rates

    prof = Profile(trainer_step_ops=0.0)
    hw = parse_hardware("A100-80GB")
    st = Strategy(**{**BASE, "method": "qlora", "lora_dropout": 0.0})
    q = estimate(TINY, hw, st, profile=prof).time
    lo = estimate(TINY, hw, st.model_copy(update={"method": "lora"}), profile=prof).time
    g = gpu_rates(hw.gpu, "bf16-mixed", prof)
    # 8 tokens x 2 layers: the layer's elementwise work at 4 B instead of 2 (x3 with backward); the adapters'
    # scale/add/gradient passes (7 n + 3 k values) at 4 B instead of 2 but their input no longer cast (fp32
    # already: 2 x (2 + 4) B per input value); + the Linear4bit casts both ways. Adapted: sum k = 512, sum n = 512.
    # The layer's work runs at the bandwidth of its transfer size (8 tokens x h 64 x 4 B vs 2 B)
    q_bytes = 8 * 2 * (3 * elementwise_bytes(TINY, 4.0) + 4 * (7 * 512 + 3 * 512) + 2 * kbit_cast_bytes(TINY, 2.0))
    lo_bytes = 8 * 2 * (3 * elementwise_bytes(TINY, 2.0) + 2 * (7 * 512 + 3 * 512) + 2 * 6 * 512)
    extra = q_bytes / g.bandwidth(8 * 64 * 4.0) - lo_bytes / g.bandwidth(8 * 64 * 2.0)
    assert q["memory_bound_seconds"] - lo["memory_bound_seconds"] == pytest.approx(extra)


def test_qlora_pays_each_linear4bit_calls_own_cost(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    st = Strategy(**{**BASE, "method": "qlora", "precision": "fp32"})
    plain = estimate(TINY, cpu_pool(), st).time
    called = estimate(TINY, cpu_pool(dequant={"nf4": None, "nf4_call_s": 5e-4}), st).time
    # 7 Linear4bit per layer x 2 layers x 0.5 ms (forward + input gradient); x1.5 under checkpointing
    assert called["dequant_seconds"] - plain["dequant_seconds"] == pytest.approx(14 * 5e-4)
    gc = st.model_copy(update={"gradient_checkpointing": True})
    assert (estimate(TINY, cpu_pool(dequant={"nf4": None, "nf4_call_s": 5e-4}), gc).time["dequant_seconds"]
            - estimate(TINY, cpu_pool(), gc).time["dequant_seconds"]) == pytest.approx(1.5 * 14 * 5e-4)


def test_profile_is_the_median_of_the_kept_calibrations():
    from memfit.spec.hwprofile import KEEP, with_history

    def cal(small, day):
        g = {"small": small, "large": 2 * small, "skinny": 1e9, "widths": {"small": 128.0, "large": 1024.0}}
        return rates(gemm={"1": {"fp32": g}}, measured_at=day)
    merged = None
    for small, day in ((3e10, "2026-11-29"), (6e10, "2026-11-30"), (4.5e10, "2026-11-30")):
        merged = with_history(cal(small, day), merged)
    assert merged.gemm["1"]["fp32"]["small"] == 4.5e10 and merged.gemm["1"]["fp32"]["large"] == 9e10
    assert len(merged.history) == 3 and merged.basis == "measured on this machine 2026-11-30, median of 3 calibrations"
    for _ in range(KEEP):  # only the last KEEP are kept: the early slow one drops out
        merged = with_history(cal(6e10, "2026-12-01"), merged)
    assert len(merged.history) == KEEP and merged.gemm["1"]["fp32"]["small"] == 6e10
    # a file written before the history existed counts as one calibration
    assert len(with_history(cal(1e10, "2026-12-02"), cal(3e10, "2026-12-01")).history) == 2
    # the merged profile survives its own file format
    assert hwprofile.HardwareRates.from_dict(json.loads(json.dumps(merged.to_dict()))) == merged


def test_fresh_gradients_and_adamw_temporaries_of_large_tensors_each_step():
    from memfit.steptime.cpu import step_fresh_bytes

    # a 50k x 256 embedding and head in fp32 (51.5 MB each) and a 256 x 688 linear (0.7 MB): each large tensor
    # gets a new gradient and AdamW's sqrt and division on a CPU, 3 x 51.5 MB; the small one none
    big, small = 50257 * 256, 256 * 688
    assert step_fresh_bytes([big, big, small], 32 << 20, 4.0) == 2 * 3 * big * 4.0
    # bf16 gradients of a 24 MiB-in-fp32 tensor stay under the threshold, its fp32 temporaries do not
    mid = 6 << 20  # values: 12 MiB in bf16, 24 MiB in fp32
    assert step_fresh_bytes([mid], 16 << 20, 2.0) == 2 * mid * 4.0


def test_lora_dropout_on_a_cpu_costs_its_measured_time_per_value(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    st = Strategy(**{**BASE, "method": "lora", "precision": "fp32", "lora_dropout": 0.05,
                     "lora_targets": ["q_proj", "v_proj"]})
    bw = {"1": 1e10, "2": 1e10}
    by_bytes = estimate(TINY, cpu_pool(bandwidth=bw), st).time
    timed = estimate(TINY, cpu_pool(bandwidth={**bw, "dropout_s_per_value": 5e-9}), st).time
    # q and v each draw over their 64-wide input: 8 tokens x 2 layers x 128 values at 5 ns, in place of the
    # forward's 4 passes of 4 B per value at 1e10 B/s
    values = 8 * 2 * (64 + 64)
    assert timed["memory_bound_seconds"] - by_bytes["memory_bound_seconds"] == pytest.approx(
        values * 5e-9 - values * 16.0 / 1e10)
    gc = estimate(TINY, cpu_pool(bandwidth={**bw, "dropout_s_per_value": 5e-9}),
                  st.model_copy(update={"gradient_checkpointing": True})).time
    gc_bytes = estimate(TINY, cpu_pool(bandwidth=bw), st.model_copy(update={"gradient_checkpointing": True})).time
    assert gc["memory_bound_seconds"] - gc_bytes["memory_bound_seconds"] == pytest.approx(
        2 * (values * 5e-9 - values * 16.0 / 1e10))  # the recomputed forward draws again
