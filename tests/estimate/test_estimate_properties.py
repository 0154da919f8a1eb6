"""Monotonic behaviour over real presets, the Profile file, and bad input."""

import itertools

import pytest

from memfit.errors import ConfigError
from memfit.estimate import Profile, estimate
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy

MODELS = [resolve_model(n) for n in ("llama-2-7b", "llama-2-70b", "llama-3.1-8b", "qwen2.5-7b", "falcon-180b")]
SEQS = (256, 1024, 4096)
METHODS = ("full", "lora", "qlora")


def states(est):
    return est.gpu["weights"] + est.gpu["gradients"] + est.gpu["optimizer"]


def test_more_gpus_never_more_memory_under_zero3():
    for m, s, method in itertools.product(MODELS, SEQS, METHODS):
        for engine in ({"zero_stage": 3}, {"fsdp": "full_shard"}):
            # QLoRA is sharded only with its 4-bit data stored in the parameter dtype (fsdp-qlora.md; with the
            # uint8 default accelerate leaves it out of FSDP2, so more GPUs add NCCL buffers and nothing else)
            storage = {"quant_storage": "bf16"} if method == "qlora" else {}
            st = Strategy(method=method, seq_len=s, **engine, **storage)
            totals = [estimate(m, parse_hardware(f"{n}xA100-80GB"), st).gpu_total for n in (1, 2, 4, 8)]
            totals.append(estimate(m, parse_hardware("2x8xA100-80GB"), st).gpu_total)
            assert totals == sorted(totals, reverse=True), (m.name, s, method, engine)


def test_checkpointing_never_more_activation_memory():
    hw = parse_hardware("8xA100-80GB")
    for m, s, method, att in itertools.product(MODELS, SEQS, METHODS, ("eager", "sdpa")):
        kw = dict(method=method, seq_len=s, attention=att, zero_stage=2, micro_batch_size=2)
        on = estimate(m, hw, Strategy(gradient_checkpointing=True, **kw))
        off = estimate(m, hw, Strategy(gradient_checkpointing=False, **kw))
        assert (on.gpu["activations"] + on.gpu["lora_intermediates"]
                <= off.gpu["activations"] + off.gpu["lora_intermediates"])
        assert on.step_seconds >= off.step_seconds  # recomputation costs time
        assert on.gpu_total <= off.gpu_total


def test_eager_never_less_than_sdpa():
    hw = parse_hardware("8xA100-80GB")
    for m, s in itertools.product(MODELS, SEQS):
        eager = estimate(m, hw, Strategy(method="lora", seq_len=s, attention="eager"))
        sdpa = estimate(m, hw, Strategy(method="lora", seq_len=s, attention="sdpa"))
        assert eager.gpu_total >= sdpa.gpu_total and eager.step_seconds >= sdpa.step_seconds


def test_higher_zero_stage_never_more_model_state():
    hw = parse_hardware("8xV100-32GB")
    for m, method in itertools.product(MODELS, METHODS):
        st = [states(estimate(m, hw, Strategy(method=method, zero_stage=z, precision="fp16-mixed"))) for z in range(4)]
        assert st == sorted(st, reverse=True), (m.name, method)


def test_longer_sequences_and_bigger_batches_cost_more():
    hw = parse_hardware("8xA100-80GB")
    for m in MODELS:
        totals = [estimate(m, hw, Strategy(method="lora", seq_len=s)).gpu_total for s in (128, 512, 2048, 8192)]
        assert totals == sorted(totals)
        b1 = estimate(m, hw, Strategy(method="lora", micro_batch_size=1))
        b4 = estimate(m, hw, Strategy(method="lora", micro_batch_size=4))
        assert b4.gpu_total > b1.gpu_total and b4.tokens_per_second > b1.tokens_per_second


def test_offload_lowers_gpu_raises_cpu():
    hw = parse_hardware("8xV100-32GB")
    m = resolve_model("llama-2-13b")
    base = estimate(m, hw, Strategy(method="full", zero_stage=3, precision="fp16-mixed"))
    opt = estimate(m, hw, Strategy(method="full", zero_stage=3, precision="fp16-mixed", offload="optimizer"))
    par = estimate(m, hw, Strategy(method="full", zero_stage=3, precision="fp16-mixed", offload="optimizer+params"))
    assert base.gpu_total > opt.gpu_total > par.gpu_total
    assert base.cpu["offloaded_optimizer"] == 0 < opt.cpu["offloaded_optimizer"]
    assert par.cpu["offloaded_params"] > 0 and opt.step_seconds > base.step_seconds


def test_frozen_weights_floor():
    hw = parse_hardware("8xA100-80GB")
    m = resolve_model("llama-2-70b")
    lora = estimate(m, hw, Strategy(method="lora", zero_stage=2)).to_dict()["floors"]["memory_bytes"]
    qlora = estimate(m, hw, Strategy(method="qlora", zero_stage=2)).to_dict()["floors"]["memory_bytes"]
    z3 = estimate(m, hw, Strategy(method="lora", zero_stage=3)).to_dict()["floors"]["memory_bytes"]
    assert lora == 2 * m.parameters and qlora < lora / 3 and z3 == pytest.approx(lora / 8, abs=1)


def test_margin_changes_fit():
    m = resolve_model("llama-2-7b")
    hw = parse_hardware("A100-80GB")
    st = Strategy(method="lora", seq_len=2048)
    est = estimate(m, hw, st, margin=0.0)
    margin = 1 - est.gpu_total / hw.gpu.memory_bytes + 0.01
    assert est.fits and not estimate(m, hw, st, margin=margin).fits
    assert "over by" in estimate(m, hw, st, margin=margin).reasons[0]


def test_cpu_device_counts_one_ram():
    hw = parse_hardware("local", cpu_ram="2GB")
    if not hw.gpu.is_cpu:
        pytest.skip("a GPU machine")
    est = estimate(resolve_model("llama-2-7b"), hw, Strategy(method="lora", precision="fp32"))
    assert not est.fits and est.reasons[0].startswith("RAM: needs")
    assert est.gpu_overhead["cuda_context"] == 0


def test_lora_targets_that_match_nothing():
    m = resolve_model("llama-2-7b")
    est = estimate(m, parse_hardware("A100-80GB"), Strategy(method="lora", lora_targets=("query_key_value",)))
    assert not est.fits and "match no linear" in est.reasons[0] and "q_proj" in est.reasons[0]
    # PEFT's Llama default on Falcon means every linear, not nothing
    f = resolve_model("falcon-7b")
    assert estimate(f, parse_hardware("A100-80GB"), Strategy(method="lora")).trainable_parameters > 0


def test_profile_roundtrip_and_errors(tmp_path):
    p = Profile().with_values(gemm_max_fraction=0.33)
    p = Profile(**{**p.to_dict(), "calibrated": {"gemm_max_fraction": 4.2}})
    path = p.save(tmp_path / "prof.json")
    q = Profile.load(path)
    assert q.gemm_max_fraction == 0.33 and q.calibrated == {"gemm_max_fraction": 4.2}
    assert all(isinstance(getattr(q, n), float) for n in Profile.constant_names())
    (tmp_path / "bad.json").write_text('{"utilisation": 0.5}')
    with pytest.raises(ConfigError, match="unknown constant 'utilisation'"):
        Profile.load(tmp_path / "bad.json")
    (tmp_path / "bad2.json").write_text('{"gemm_max_fraction": "high"}')
    with pytest.raises(ConfigError, match="must be a number"):
        Profile.load(tmp_path / "bad2.json")
    assert ("gemm_max_fraction" in Profile.calibratable_names()
            and "qlora_fp32_upcast" not in Profile.calibratable_names())
    with pytest.raises(ConfigError, match=r"margin 1.5: must be a fraction"):
        estimate(resolve_model("llama-2-7b"), parse_hardware("A100-80GB"), Strategy(), margin=1.5)
    with pytest.raises(ConfigError, match="korthikanti"):
        estimate(resolve_model("llama-2-7b"), parse_hardware("A100-80GB"), Strategy(), activation_formula="gpt")


def test_processes_on_the_cpu_share_ram_and_cores():
    m = resolve_model("llama-2-7b")
    one = estimate(m, parse_hardware("CPU", cpu_ram="64GB"), Strategy(method="lora", precision="fp32"))
    two = estimate(m, parse_hardware("2xCPU", cpu_ram="64GB"),
                   Strategy(method="lora", precision="fp32", fsdp="full_shard"))
    assert two.hardware.world_size == 2 and two.gpu_total < one.gpu_total
    # each torchrun rank: the CPU process baseline + its process group and engine imports
    assert two.cpu["process_baseline"] == 2 * (one.cpu["process_baseline"] + 0.12e9)
    assert one.cpu["process_baseline"] == 0.6e9  # a CPU-only process: no CUDA libraries or context
    assert two.time["matmul_seconds"] == pytest.approx(2 * one.time["matmul_seconds"])  # cores shared
    small = estimate(m, parse_hardware("2xCPU", cpu_ram="40GB"),
                     Strategy(method="lora", precision="fp32", fsdp="full_shard"))
    assert not small.fits and "model 2 x" in small.reasons[0]


def test_every_combination_is_well_formed():
    import math

    engines = ({}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3}, {"fsdp": "full_shard"},
               {"fsdp": "shard_grad_op"})
    count = 0
    for m in (MODELS[0], MODELS[1], MODELS[4]):
        for hw in (parse_hardware("2x8xA100-80GB"), parse_hardware("2xCPU")):
            for method, eng, gc, off, prec in itertools.product(
                    ("full", "lora", "qlora", "meft"), engines, (False, True),
                    ("none", "optimizer", "optimizer+params"), ("fp32", "bf16-mixed", "bf16")):
                try:
                    st = Strategy(method=method, gradient_checkpointing=gc, offload=off, precision=prec,
                                  seq_len=1024, micro_batch_size=2, grad_accum=2, **eng)
                except ValueError:
                    continue
                est = estimate(m, hw, st)
                g = est.gpu
                assert abs(sum(v for k, v in g.items() if k != "total") - g["total"]) < 1e-3 * g["total"]
                assert g["peak_concurrency"] <= 1e-6 * g["total"]
                assert all(v >= 0 for k, v in g.items() if k != "peak_concurrency")
                assert all(v >= 0 for v in est.cpu.values())
                assert (all(math.isfinite(v) for v in est.time.values() if not isinstance(v, str))
                        and est.step_seconds > 0)
                count += 1
    assert count > 1000


def test_accumulated_gradients_stay_live():
    hw = parse_hardware("8xA100-80GB")
    m = resolve_model("llama-2-7b")
    kw = dict(method="full", seq_len=2048, micro_batch_size=2)
    one = estimate(m, hw, Strategy(zero_stage=1, grad_accum=1, **kw))
    four = estimate(m, hw, Strategy(zero_stage=1, grad_accum=4, **kw))
    assert four.gpu_total > one.gpu_total  # ZeRO-1 keeps the full 16-bit gradients between micro-batches
    z2 = estimate(m, hw, Strategy(zero_stage=2, grad_accum=4, **kw))
    assert z2.gpu_total < four.gpu_total  # ZeRO-2 accumulates into its partition
