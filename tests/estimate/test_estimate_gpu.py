"""The CUDA side of the estimator, pinned to hand-computed bytes (issue 9)."""

import pytest

from memfit.estimate import Profile, estimate
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy
from cli_helper import run_cli

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
    kw = dict(s=1024, b=1, e=2.0, attention="fa2", checkpointing=True, profile=P, trained=False, shares=False)
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


def test_mixtral_holds_every_expert_and_routes_top_k():
    m = resolve_model("mixtral-8x7b")
    # per layer: q, o 4096^2 + k, v 4096 x 1024 + router 4096 x 8 + 8 experts x 3 x 4096 x 14336 + 2 norms
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 4096 * 8 + 8 * 3 * 4096 * 14336 + 2 * 4096
    assert m.layer_parameters == layer
    assert m.parameters == 32 * layer + 2 * 32000 * 4096 + 4096 == 46_702_792_704
    assert m.intermediate == 2 * 14336  # the MLP width a token passes through (top-2)
    # LoRA on the experts' w1: one adapter per expert, r x (4096 + 14336) each
    assert m.lora_parameters(("w1",), 8) == 32 * 8 * 8 * (4096 + 14336)
    from memfit.estimate import activations as A
    # backward: experts run one after another on their top-2/8 share: the residual gradient 2 B x 4096 and
    # two gradients (act's, up's; the product was saved) of width 2 x 14336 / 8 = 3584
    extra = A.backward_extra_bytes(m, 1024, 1, 2.0, 2.0, "sdpa", 0.0)
    assert extra == 1024 * (2 * 4096 + 2 * 3584 * 2)
    # the flash-attn package's backward is larger here (flash_api.cpp mha_bwd): dout, dq, dk, dv, the fp32
    # dq_accum and softmax_d, and dk / dv expanded to the 32 query heads (8 KV heads)
    flash = 2 * 4096 + 2 * (4096 + 2 * 1024) + 4 * 4096 + 4 * 32 + 2 * 2 * 4096
    assert A.backward_extra_bytes(m, 1024, 1, 2.0, 2.0, "fa2", 0.0) == 1024 * (2 * 4096 + flash)


def test_qwen2_moe_shared_expert_and_gpt_bigcode_and_granite():
    q = resolve_model("qwen1.5-moe-a2.7b")
    assert q.parameters == 14_315_784_192 and q.intermediate == 4 * 1408 + 5632
    assert set(q.linear_names()) >= {"gate_proj", "up_proj", "down_proj", "shared_expert_gate"}
    sc = resolve_model("santacoder")
    # per layer: c_attn 2048 x (2048 + 2 x 128) + c_proj 2048^2 + c_fc, c_proj 2 x 2048 x 8192, biases,
    # 2 LayerNorms (weight + bias); wte 49280 x 2048 (tied head) + wpe 2048 x 2048 + ln_f
    layer = 2048 * 2304 + 2304 + 2048**2 + 2048 + 2 * 2048 * 8192 + 8192 + 2048 + 2 * 2 * 2048
    assert sc.parameters == 24 * layer + 49280 * 2048 + 2048 * 2048 + 2 * 2048 == 1_124_886_528
    assert sc.kv_heads == 1 and sc.hidden_dropout == 0.1
    assert sc.lora_parameters(("c_proj",), 8) == 24 * 8 * ((2048 + 2048) + (8192 + 2048))  # both c_proj
    g = resolve_model("granite-3.0-8b")
    assert g.family == "granite" and g.parameters == 8_170_848_256


def test_nf4_quant_state_is_neither_sharded_nor_offloaded():
    # bitsandbytes keeps absmax/nested quant in Params4bit.quant_state (a module attribute): ZeRO-3 and FSDP
    # shard the packed 4-bit data only, so every rank holds all of it (cuda-memory.md; bnb issue 1945)
    m = resolve_model("llama-2-70b")
    linear = 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672)
    assert m.linear_layer_parameters == linear == 68_451_041_280
    other = m.parameters - linear
    p_t = 80 * 8 * ((8192 + 8192) * 2 + (8192 + 1024) * 2 + (8192 + 28672) * 2 + (28672 + 8192))
    st = Strategy(method="qlora", zero_stage=3, lora_r=8, lora_targets=("all-linear",), quant_storage="bf16",
                  gradient_checkpointing=True)
    est = estimate(m, parse_hardware("2xA100-40GB"), st)
    qs = linear * 0.0159  # double-quant absmax per value
    weights_all = linear * (0.5 + 0.0159) + other * 2 + p_t * 2  # DeepSpeed holds the adapters in bf16
    dequant = 8192 * 28672 * 2  # the running Linear4bit's 16-bit weight
    assert est.gpu["weights"] == pytest.approx((weights_all - qs) / 2 + qs + dequant, rel=1e-12)
    # ZeRO-3's live-parameter limit counts stored elements: a bf16 element packs 4 NF4 values, so the 1e9
    # default gathers 4e9 values' worth: 4e9 x (weights_all - qs) / P bytes
    assert est.gpu["gathered_params"] == pytest.approx(4e9 * (weights_all - qs) / m.parameters, rel=1e-12)
    off = estimate(m, parse_hardware("2xA100-40GB"), st.model_copy(update={"offload": "optimizer+params"}))
    assert off.gpu["weights"] == pytest.approx(qs + dequant, rel=1e-12)  # offload keeps these on the GPU


def test_sdpa_backend_by_gpu_generation():
    from memfit.estimate.cuda import sdpa_backend
    from memfit.spec.hardware import find_gpu
    l8, l2 = resolve_model("llama-3.1-8b"), resolve_model("llama-2-7b")
    assert sdpa_backend(find_gpu("A100-80GB"), l8, "bf16-mixed", "sdpa") == "flash"
    # V100: no flash (sm70); with a padding mask transformers expands k/v and memory-efficient runs
    assert sdpa_backend(find_gpu("V100-32GB"), l8, "fp16-mixed", "sdpa") == "memory-efficient"
    # packed batches carry no mask: enable_gqa=True, which memory-efficient rejects -> the math kernel
    assert sdpa_backend(find_gpu("V100-32GB"), l8, "fp16-mixed", "sdpa", packed=True) == "math"
    assert sdpa_backend(find_gpu("V100-32GB"), l2, "fp16-mixed", "sdpa", packed=True) == "memory-efficient"
    assert sdpa_backend(find_gpu("A100-80GB"), l8, "fp32", "sdpa", packed=True) == "math"  # flash needs 16-bit
    assert sdpa_backend(find_gpu("A100-80GB"), l8, "bf16-mixed", "fa2") == "flash_attention_2"
    st = Strategy(method="lora", seq_len=2048)
    assert estimate(l8, A100, st).to_dict()["memory"]["attention_backend"] == "flash"
    assert estimate(l8, parse_hardware("1xV100-32GB"),
                    st.model_copy(update={"precision": "fp16-mixed"})).attention_backend == "memory-efficient"


def test_reserved_is_allocated_plus_cached_layer_working_sets():
    from memfit.estimate.cuda import context_bytes, nccl_bytes, reserved_gap
    from memfit.spec.hardware import find_gpu
    p = Profile(fragmentation=0.04, allocator_cached_layers=0.75, allocator_cached_loss=0.5)
    # a layer's forward + backward working set (2 GB) cached; the loss's blocks (3 GB) when the step is the peak
    assert reserved_gap(10e9, 2e9, 3e9, False, p) == 0.75 * 2e9 + 0.5 * 3e9 + 0.04 * 10e9
    assert reserved_gap(10e9, 2e9, 0.0, False, p) == 0.75 * 2e9 + 0.04 * 10e9
    assert reserved_gap(10e9, 2e9, 3e9, False, p, expandable=True) == 0.04 * 10e9
    gib = 2**30
    assert context_bytes(find_gpu("A100-80GB"), p) == 0.8 * gib
    assert context_bytes(find_gpu("H100-80GB"), p) == 0.9 * gib
    assert nccl_bytes(parse_hardware("1xA100-80GB"), p) == 0
    assert nccl_bytes(parse_hardware("8xH100-80GB"), p) == 1.5 * gib  # NVLink buffers + NVLS
    assert nccl_bytes(parse_hardware("2xRTX4090-24GB"), p) == 0.2 * gib  # PCIe, few channels
    est = estimate(resolve_model("mistral-7b"), A100, Strategy(method="lora"))
    d = est.to_dict()["memory"]
    assert d["gpu_reserved_bytes"] - d["gpu_allocated_bytes"] == round(est.gpu_overhead["allocator_fragmentation"])
    assert abs(d["gpu_bytes"]["total"] - d["gpu_reserved_bytes"] - 0.8 * gib) <= 1


def test_fsdp_units_at_their_real_dtype_and_one_layers_adapter_grads():
    # accelerate 1.15 (fsdp_utils.py:865-880): decoder layers, an untied embedding, and a tail unit (final
    # norm + lm_head) that stays gathered from the forward's end until its backward. LoRA r=8 on q, v of
    # Llama-2-7B under bf16 mixed precision: layers gathered in bf16
    m = resolve_model("llama-2-7b")
    layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert m.layer_parameters == layer == 202_383_360
    adapters = 8 * (4096 + 4096) * 2  # one layer's q and v adapters
    layer_b = layer * 2 + adapters * 2
    tail_b = (32000 * 4096 + 4096) * 2  # lm_head and the final norm, frozen, 16-bit
    st = Strategy(method="lora", fsdp="full_shard", lora_r=8, lora_targets=("q_proj", "v_proj"),
                  gradient_checkpointing=True)
    est = estimate(m, parse_hardware("2xA100-80GB"), st)
    assert est.gpu["gathered_params"] == 2 * layer_b + tail_b  # current + prefetched layer, and the tail
    # one layer's adapters' unsharded bf16 gradients + the reduce-scatter output (1/2 of them)
    assert est.gpu["comm_buffers"] == adapters * 2 * 1.5
    off = estimate(m, parse_hardware("2xA100-80GB"), st.model_copy(update={"offload": "optimizer+params"}))
    # CPUOffloadPolicy: each gathered layer's shard is first copied to the GPU (_fsdp_param.py:897-899)
    assert off.gpu["gathered_params"] == 2 * layer_b + tail_b + 2 * layer_b / 2
    assert off.gpu["weights"] == 0  # parameters, gradients and optimizer state on the CPU
    # QLoRA with the default uint8 storage: accelerate leaves Params4bit out of FSDP2 (fsdp_utils.py:800-811)
    q8 = estimate(m, parse_hardware("2xA100-80GB"), Strategy(method="qlora", fsdp="full_shard"))
    q16 = estimate(m, parse_hardware("2xA100-80GB"), Strategy(method="qlora", fsdp="full_shard",
                                                              quant_storage="bf16"))
    linear = 32 * (4 * 4096**2 + 3 * 4096 * 11008)
    assert q8.gpu["weights"] - q16.gpu["weights"] == pytest.approx(linear * 0.5 / 2, rel=1e-9)


def test_deepspeed_buckets_from_the_runs_settings():
    from memfit.spec.run import DistributedSpec
    m = resolve_model("llama-2-70b")
    hw = parse_hardware("8xA100-80GB")
    st = Strategy(method="lora", zero_stage=2, lora_r=8, lora_targets=("q_proj", "v_proj"))
    # the reduce bucket is allocated whole (stage_1_and_2.py:3266), twice with overlap_comm (:3273):
    # HF's 'auto' = hidden^2 = 8192^2 elements in bf16, whatever few adapter gradients there are
    assert estimate(m, hw, st).gpu["comm_buffers"] == 2 * 8192**2 * 2
    d = DistributedSpec(reduce_bucket_size=500_000_000, allgather_bucket_size=100_000)
    est = estimate(m, hw, st, distributed=d)
    assert est.gpu["comm_buffers"] == 2 * 500_000_000 * 2
    p_t = est.trainable_parameters
    # the all-gather bucket (min(allgather_bucket_size, P_t) x 2 B) + the fp32 copy of the gradient partition
    assert est.gpu["step_temporaries"] == 100_000 * 2 + p_t / 8 * 4
    z3 = estimate(m, hw, st.model_copy(update={"zero_stage": 3}), distributed=d)
    assert z3.gpu["comm_buffers"] == 500_000_000 * 2  # ZeRO-3: one bucket (stage3.py:782)


def test_qlora_loading_peak_on_one_gpu():
    # loading quantises each 16-bit tensor on the GPU: the NF4 model + quant state + the rest in bf16, plus
    # the larger of one 16-bit tensor being quantised and the fp32 upcast of the biggest non-quantised one
    m = resolve_model("llama-3.1-8b")
    linear = m.linear_layer_parameters
    other = m.parameters - linear
    est = estimate(m, A100, Strategy(method="qlora", gradient_checkpointing=True))
    expected = linear * (0.5 + 0.0159) + other * 2 + max(128256 * 4096 * 2, 128256 * 4096 * 4)
    assert est.gpu_loading == pytest.approx(expected, rel=1e-12)
    assert est.to_dict()["memory"]["gpu_loading_bytes"] == round(expected)
    assert estimate(m, A100, Strategy(method="lora")).gpu_loading == 0


def _cli(capsys, *argv):
    return run_cli(capsys, *argv)[:2]


def test_estimate_says_what_it_is(capsys):
    import json
    argv = ("estimate", "--model", "mistral-7b", "--gpus", "1xA100-80GB", "--method", "qlora")
    code, out = _cli(capsys, *argv, "--json")
    assert code == 0
    mem = json.loads(out)["memory"]
    gpu = mem["gpu_bytes"]
    assert abs(mem["gpu_allocated_bytes"] - (gpu["total"] - gpu["overhead"])) <= 1
    assert mem["gpu_allocated_bytes"] < mem["gpu_reserved_bytes"] < gpu["total"]
    assert mem["attention_backend"] == "flash"
    err = mem["published_error"]
    assert err["kind"] == "qlora, 1 GPU" and err["figures"] >= 4
    # the range is leave-one-group-out, labelled with its basis (bench/provenance.json: development, since rules
    # were chosen seeing these groups), with its date and the in-sample range beside it
    assert err["basis"] == "development" and err["rests_on"] >= 1 and err["in_sample"]["basis"] == "in_sample"
    assert err["date"] and err["basis_rows"] > err["rows"] > 0 and "held_out" not in err
    assert err["min_pct"] <= err["in_sample"]["max_pct"] and err["in_sample"]["figures"] == err["figures"]
    code, text = _cli(capsys, *argv)
    assert code == 0
    assert "reserved (caching allocator)" in text and "SDPA backend assumed: flash" in text
    assert "qlora, 1 GPU: within" in text and "development" in text and "held out" not in text


def test_profiles_saved_before_still_load(tmp_path):
    import json
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"optimizer_step_temp_bytes_gpu": 0.0, "fragmentation": 0.05}))
    assert Profile.load(path).fragmentation == 0.05
