"""The GPU time model from parts (memfit.steptime): each part pinned to hand-computed seconds for one shape,
and to the published measurements each part's constants come from."""

import math

import pytest

from memfit.estimate import Profile, estimate
from memfit.steptime.comm import exposed_comm
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import model_from_config
from memfit.spec.strategy import Strategy
from memfit.steptime.attention import fused_rate
from memfit.steptime.gemm import gemm_seconds, occupancy
from memfit.steptime.rates import GpuRates, gpu_rates

TINY = model_from_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2,
                          "vocab_size": 100}, name="tiny")
BASE = dict(method="full", seq_len=8, micro_batch_size=1, precision="bf16-mixed", attention="sdpa")
A100 = parse_hardware("A100-80GB")


def h100(**kw) -> GpuRates:
    base = dict(name="H100", sms=132, peak=989e12, fp32_peak=67e12, matmul_max=0.8, gemm_kernel_seconds=5e-6,
                small_tile_efficiency=0.8, hbm=3350e9, bandwidth_max=0.9, bandwidth_half_bytes=2e6,
                attention_max=0.37, attention_half_seq=400.0, package_attention_max=0.33, fused_attention=True,
                host_op_seconds=3e-5)
    return GpuRates(**{**base, **kw})


def test_gemm_by_hand_tile_and_wave_quantisation():
    g = h100()
    # 4096^3: 32 x 32 = 1,024 tiles of 128 x 128 in ceil(1024 / 132) = 8 waves -> 1024 / 1056 of the SMs busy
    assert occupancy(4096, 4096, 4096, 132, 0.8) == pytest.approx(1024 / 1056)
    t = 2 * 4096 ** 3 / (989e12 * 0.8 * 1024 / 1056) + 5e-6
    assert gemm_seconds(4096, 4096, 4096, g) == pytest.approx(t)
    # 1024 x 1024 x 2048: 64 tiles of 128 fill half a wave; 128 tiles of 64 x 128 (at 0.8) fill 128 / 132
    assert occupancy(1024, 1024, 2048, 132, 0.8) == pytest.approx(0.8 * 128 / 132)
    # a LoRA product (rank 16) is memory-bound: A (4096 x 4096), B, C read / written once at the bandwidth
    nbytes = 2 * (4096 * 4096 + 4096 * 16 + 4096 * 16)
    assert gemm_seconds(4096, 16, 4096, g) == pytest.approx(nbytes / g.bandwidth(nbytes) + 5e-6)


@pytest.mark.parametrize("m,n,k,measured", [(4096, 4096, 4096, 783), (2048, 2048, 2048, 632),
                                            (1024, 2048, 2048, 524), (1024, 1024, 2048, 350),
                                            (256, 2048, 4096, 286), (256, 2048, 256, 42), (512, 256, 256, 11.5)])
def test_gemm_against_xla_measured_h100_table(m, n, k, measured):
    # tensorflow/xla matmul_interpolator_data.h (bf16, TFLOP/s): within 25 % over three orders of magnitude
    rate = 2 * m * n * k / gemm_seconds(m, n, k, h100()) / 1e12
    assert rate == pytest.approx(measured, rel=0.25)


@pytest.mark.parametrize("seq,measured", [(512, 100), (1024, 130), (2048, 155), (4096, 170), (8192, 180)])
def test_fused_attention_follows_fa2_paper_a100_curve(seq, measured):
    # FA2 paper (arXiv 2307.08691) Fig. 6, A100, causal, head dim 128, 16k tokens per batch, forward + backward;
    # the paper counts causal FLOPs as half the square, memfit's rate is per full-square FLOP (x 0.5 for causal)
    g = gpu_rates(A100.gpu, "bf16-mixed", Profile())
    rate = fused_rate(16384 / seq, 16, seq, 128, g) * 0.5 / 1e12
    assert rate == pytest.approx(measured, rel=0.12)


def test_bandwidth_curve_through_calculon_bins():
    g = h100(bandwidth_half_bytes=2e6)
    # Calculon (systems/a100_80g.json): >= 100 MB 0.90, >= 10 MB 0.75, >= 1 MB 0.60 (below 0.30)
    assert g.bandwidth(100e6) / g.hbm == pytest.approx(0.9 * 100 / 102)
    assert g.bandwidth(10e6) / g.hbm == pytest.approx(0.75)
    assert g.bandwidth(1e6) / g.hbm == pytest.approx(0.3)


def test_tiny_step_by_hand_launch_bound_gemms_and_host():
    prof = Profile(trainer_step_ops=0.0, trainer_micro_batch_ops=0.0, trainer_outside_step_ops=0.0,
                   trainer_outside_micro_batch_ops=0.0)
    t = estimate(TINY, A100, Strategy(**BASE), profile=prof).time
    # 8 tokens: every GEMM is its fixed 5 us. Full: forward, input and weight gradient of 7 linears x 2 layers
    # and of the head = 45 GEMMs (their FLOPs add nanoseconds, their few KB at small-transfer bandwidth < 5 %)
    assert 45 * 5e-6 < t["matmul_seconds"] < 45 * 5e-6 * 1.05
    # host: 49 module-level ops per layer (norms 2 x 7, 4 attention linears, RoPE 12, SDPA 4, residuals 2, MLP
    # 5, views 8) x 2 layers + 20 for the rest, each gpu_host_op_seconds forward + backward; the host bounds it
    assert t["dispatch_seconds"] == pytest.approx((49 * 2 + 20) * prof.gpu_host_op_seconds)
    assert t["compute_seconds"] == pytest.approx(t["dispatch_seconds"])
    assert t["basis"].startswith("catalog GPU, parts model")


def test_optimizer_and_offload_by_hand():
    prof = Profile()
    hw = parse_hardware("8xA100-80GB")
    full = estimate(TINY, hw, Strategy(**BASE, zero_stage=2), profile=prof).time
    off = estimate(TINY, hw, Strategy(**BASE, zero_stage=2, offload="optimizer"), profile=prof).time
    p = TINY.parameters
    # offloaded AdamW: the node's CPU Adam rate shared by its 8 processes, each stepping its 1/8 partition
    assert off["cpu_optimizer_seconds"] == pytest.approx(p / 8 * 8 / prof.cpu_adam_params_per_second_node)
    assert full["cpu_optimizer_seconds"] == 0.0
    # AdamW on the GPU: 80 B per fp32 parameter at adam_bandwidth_fraction of the HBM (2039 GB/s)
    from memfit.steptime.speeds import catalog_speeds
    sp = catalog_speeds(A100, "bf16-mixed", "sdpa", prof)
    assert sp.adam_per_param == pytest.approx(80.0 / (2039e9 * prof.adam_bandwidth_fraction))
    # the speeds are per fp32 parameter whatever the precision; the run's dtypes scale them at use
    assert catalog_speeds(A100, "bf16", "sdpa", prof).adam_per_param == pytest.approx(sp.adam_per_param)


def test_optimizer_phase_follows_the_trainable_dtype():
    """Pure bf16 full fine-tuning sweeps 16-bit states and gradients (AdamW's 80 B per fp32 value halved, the
    clipping pass at 2 B); PEFT's fp32 adapters keep fp32 states under pure bf16; bitsandbytes' 8-bit AdamW is
    one fused pass: parameter read + written, gradient read, two 1-byte moments read + written."""
    from memfit.estimate.setup import Setup
    from memfit.methods import METHODS
    from memfit.steptime.speeds import catalog_speeds

    def dtypes(**kw):
        st = Strategy(**{**BASE, **kw})
        return Setup(TINY, A100, st, Profile(), METHODS[st.method]).optimizer_dtypes()

    assert dtypes(precision="bf16") == {"grad_b": 2.0, "adam_scale": 0.5}
    assert dtypes(precision="bf16-mixed") == {"grad_b": 4.0, "adam_scale": 1.0}
    assert dtypes(precision="bf16", method="lora") == {"grad_b": 4.0, "adam_scale": 1.0}
    assert dtypes(precision="bf16", optimizer="adamw8bit") == {"grad_b": 2.0, "adam_scale": (4 + 2 + 4) / 80}
    assert dtypes(precision="bf16", zero_stage=2) == {"grad_b": 4.0, "adam_scale": 1.0}  # DeepSpeed's fp32 master
    # by hand, one A100, 0.2 B trainable values in 10 tensors: the device's sweep outlasts the host's ops
    prof = Profile()
    sp = catalog_speeds(A100, "bf16", "sdpa", prof)
    from memfit.steptime.loop import optimizer_seconds
    p_t = 2e8
    got = optimizer_seconds(sp, "ddp", p_t, 1, 10.0, p_t, 1, False, grad_b=2.0, adam_scale=0.5)
    assert got == pytest.approx(p_t * 80.0 / (2039e9 * prof.adam_bandwidth_fraction) * 0.5
                                + p_t * 2.0 * 3.0 / sp.bandwidth)


def test_exposed_comm_by_hand():
    prof = Profile()
    # FSDP: 1 s of gathers behind 2 s of compute: hidden (0.9 x 2 s window), the tax on the hidden second
    assert exposed_comm(1.0, 2.0, "zero3", prof, False, 30) == pytest.approx(1.0 / 32 + 0.25 * 1.0)
    # DDP: 3 s of all-reduce behind 2 s of compute: 0.65 x 2 = 1.3 s hidden
    assert exposed_comm(3.0, 2.0, "ddp", prof, False, 30) == pytest.approx(3.0 - 1.3 + 0.25 * 1.3)
    # CPU processes: gloo hides nothing
    assert exposed_comm(1.0, 2.0, "ddp", prof, True, 30) == pytest.approx(1.0)


def test_tokens_per_second_grows_with_sequence_on_a_7b_lora():
    # the published shape of the error the old model missed: a 7B LoRA's throughput rises from 256 to 4096
    # tokens per micro-batch (small micro-batches are launch / dispatch-bound)
    from memfit.spec.model import resolve_model
    m = resolve_model("llama-2-7b")
    rate = {s: estimate(m, A100, Strategy(method="lora", seq_len=s, micro_batch_size=1)).time["tokens_per_second"]
            for s in (256, 4096)}
    assert rate[4096] / rate[256] > 1.5
    assert math.isfinite(rate[256])


def test_host_hooks_by_hand():
    from memfit.steptime.host import dispatch_ops, engine_hook_seconds, step_host_seconds
    from memfit.steptime.ops import Dispatch, EngineHooks

    prof = Profile()

    def ops(adapters: int = 0, gc: bool = False, quantized: bool = False) -> float:
        # TINY: 49 module ops per layer x 2 + 20; a LoRA-adapted linear's wrapper 6 more each
        return dispatch_ops(Dispatch(2, 49.0, 6.0 * adapters, adapters, False, gc,
                                     quantized_calls=7.0 if quantized else 0.0), prof)

    plain = ops()
    assert plain == 49 * 2 + 20
    # QLoRA adds qlora_call_ops (12) per Linear4bit (7 per layer x 2)
    assert ops(quantized=True) - plain == 12 * 7 * 2
    # checkpointing: the recompute at gc_host_fraction (1.2, H200 calibrations) of a layer's 49 ops; a LoRA
    # adapter's 6 ops per linear again at the forward's share (0.4): 2 x (49 x 2.2 + 42 x 1.4) + 20
    assert ops(gc=True) == pytest.approx(2 * 49 * 2.2 + 20)
    assert ops(7, gc=True) == pytest.approx(2 * (49 * 2.2 + 42 * 1.4) + 20)
    # FSDP: fsdp_unit_ops (40) per unit, the 2 layers + the embedding + the tail
    assert engine_hook_seconds(EngineHooks(units=4), prof) == pytest.approx((40 * 4 * prof.gpu_host_op_seconds, 0.0))
    # DeepSpeed ZeRO-2: 30 small ops (cpu_op_seconds, 12 us) per trainable tensor per micro-batch (memfit.steptime
    # .layer hands ZeRO-1 a quarter of them per micro-batch at 4); their step bookkeeping 35 per tensor
    assert engine_hook_seconds(EngineHooks(grad_tensors=21), prof)[0] == pytest.approx(30 * 21 * 1.2e-5)
    assert step_host_seconds("zero2", 21, prof) == pytest.approx(35 * 21 * 1.2e-5)
    assert step_host_seconds("fsdp", 21, prof) == 0.0
    # ZeRO-3's fetch hooks: 8 ops x (7 linears + 2 norms + 6 other modules) x 2 layers (x1.4 under checkpointing:
    # memfit.steptime.layer's fetch_modules), waited for
    assert engine_hook_seconds(EngineHooks(fetch_modules=15 * 2), prof) == pytest.approx(
        (0.0, 8 * 15 * 2 * prof.gpu_host_op_seconds))


def test_the_layer_hands_the_engines_hooks_their_counts():
    from memfit.engines import ENGINE_COSTS
    from memfit.steptime.layer import micro_work, shape_for
    from memfit.steptime.ops import EngineHooks

    def hooks(engine: str, gc: bool = False, ga: int = 1) -> EngineHooks:
        st = Strategy(method="lora", zero_stage=int(engine[-1]) if engine.startswith("zero") else 0,
                      gradient_checkpointing=gc, grad_accum=ga)
        sh = shape_for(TINY, st, 2.0, frozenset(), 0.0, 0.0, False, ENGINE_COSTS[engine], 21.0)
        return next(op for op in micro_work(TINY, sh, st).ops if isinstance(op, EngineHooks))

    assert hooks("zero2", ga=4).grad_tensors == 21 and hooks("zero1", ga=4).grad_tensors == 21 / 4
    assert hooks("zero3").fetch_modules == 15 * 2 and hooks("zero3", gc=True).fetch_modules == 1.4 * 15 * 2
    assert hooks("fsdp-full_shard").units == 4 and hooks("ddp") == EngineHooks()


def test_eager_attention_by_hand():
    from memfit.steptime.attention import eager_seconds

    g = h100()
    b, heads, s, d = 2, 4, 1024, 64
    # 2 forward products (s x s x d each over b*H batches, stacked) and 4 gradient products, + 88 B per score
    prod = 2 * gemm_seconds(b * heads * s, s, d, g) + 4 * gemm_seconds(b * heads * s, d, s, g)
    scores = b * heads * s * s
    assert eager_seconds(b, heads, s, d, g, 2.0, 88.0) == pytest.approx((prod, scores * 88 / g.bandwidth(scores * 2)))


def test_flash_attn_package_runs_at_its_own_rate_on_hopper_only():
    """attention: fa2 is the flash-attn 2 package: on H100 its FA3-paper rate (0.33 of the peak), where SDPA runs
    torch's pick (cuDNN, 0.37); on an A100 both are the same FA2 kernels."""
    from memfit.estimate import estimate
    from memfit.spec.model import resolve_model

    model = resolve_model("llama-3.1-8b")
    st = dict(method="full", fsdp="full_shard", gradient_checkpointing=True, seq_len=65536, micro_batch_size=1,
              precision="bf16-mixed")
    att = {}
    for gpu in ("H100-80GB", "A100-80GB"):
        for kernel in ("sdpa", "fa2"):
            est = estimate(model, parse_hardware(f"8x{gpu}"), Strategy(**st, attention=kernel))
            att[gpu, kernel] = est.to_dict()["time"]["attention_seconds"]
    assert att["H100-80GB", "fa2"] == pytest.approx(att["H100-80GB", "sdpa"] * 0.37 / 0.33, rel=1e-9)
    assert att["A100-80GB", "fa2"] == pytest.approx(att["A100-80GB", "sdpa"], rel=1e-9)
