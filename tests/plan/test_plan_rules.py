"""The planner's rules: combinations that cannot run at all, each with a sentence that says the fix."""

import pytest

from memfit.plan import rules
from memfit.plan.space import enumerate_strategies, make_strategy
from memfit.errors import ConfigError
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy

V100 = parse_hardware("8xV100-32GB")
A100 = parse_hardware("8xA100-80GB")
T4 = parse_hardware("1xT4-16GB")
CPU = parse_hardware("CPU", cpu_ram="16GB")
LLAMA = resolve_model("llama-2-7b")
FALCON = resolve_model("falcon-180b")


def reasons(model, hw, **keys):
    return rules.check(model, hw, Strategy(**keys))


def test_clean_combination_passes():
    assert reasons(LLAMA, A100, method="lora", zero_stage=2, attention="fa2") == []
    assert reasons(LLAMA, V100, method="full", zero_stage=3, precision="fp16-mixed", attention="sdpa") == []


@pytest.mark.parametrize("hw, keys, needle", [
    (V100, dict(attention="fa2", precision="fp16-mixed"), "V100-32GB has no FlashAttention-2"),
    (T4, dict(attention="fa2", precision="fp16-mixed"), "T4-16GB has no FlashAttention-2"),
    (CPU, dict(attention="fa2", precision="fp32"), "does not run on the CPU"),
    (A100, dict(attention="fa2", precision="fp32"), "FlashAttention-2 computes only in fp16/bf16"),
    (V100, dict(precision="bf16-mixed"), "V100-32GB has no bf16 support; use precision=fp16-mixed"),
    (T4, dict(precision="bf16"), "T4-16GB has no bf16"),
    (CPU, dict(precision="fp16-mixed"), "fp16-mixed on the CPU"),
    (A100, dict(method="qlora", zero_stage=3), "set quant_storage=bf16"),
    (A100, dict(method="qlora", fsdp="full_shard", precision="fp16-mixed"), "set quant_storage=fp16"),
    (A100, dict(method="qlora", zero_stage=3, quant_storage="bf16", offload="optimizer+params"),
     "DeepSpeed cannot offload bitsandbytes 4-bit"),
    (A100, dict(method="meft", zero_stage=2), "runs with plain DDP only"),
    (A100, dict(method="meft", optimizer="sgd"), "use optimizer=adamw"),
    (A100, dict(fsdp="full_shard", offload="optimizer"), "FSDP's CPU offload moves parameters"),
    (A100, dict(zero_stage=2, offload="optimizer", optimizer="adamw8bit"), "8-bit optimizers need"),
    (A100, dict(zero_stage=2, offload="optimizer", optimizer="sgd"), "ZeRO-Offload steps on the CPU"),
    (CPU, dict(zero_stage=2, offload="optimizer", precision="fp32"), "already lives in CPU memory"),
    (CPU, dict(method="qlora", zero_stage=3, quant_storage="uint8", precision="fp32"), "set quant_storage=fp32"),
])
def test_rule_says_what_to_change(hw, keys, needle):
    found = reasons(LLAMA, hw, **keys)
    assert any(needle in r for r in found), found


def test_qlora_with_matching_storage_passes():
    assert reasons(LLAMA, A100, method="qlora", zero_stage=3, quant_storage="bf16") == []
    assert reasons(LLAMA, V100, method="qlora", fsdp="full_shard", quant_storage="fp16",
                   precision="fp16-mixed") == []


def test_lora_targets_must_exist_in_the_model():
    found = reasons(FALCON, A100, method="lora")  # default targets are Llama names
    assert len(found) == 1 and "query_key_value" in found[0] and "falcon-180b" in found[0]
    assert reasons(FALCON, A100, method="lora", lora_targets=("query_key_value",)) == []
    assert reasons(FALCON, A100, method="lora", lora_targets=("all-linear",)) == []
    assert reasons(FALCON, A100, method="full") == []  # full fine-tuning has no targets


def test_meft_cpu_store_must_fit_in_ram():
    small = parse_hardware("1xA100-80GB", cpu_ram="8GB")
    # 2 * 4096 * 8192 * 32 layers * 16 B = 34.4 GB for one process
    found = reasons(LLAMA, small, method="meft")
    assert len(found) == 1 and "34.4 GB" in found[0] and "8.0 GB" in found[0]
    assert reasons(LLAMA, parse_hardware("1xA100-80GB", cpu_ram="64GB"), method="meft") == []


def test_several_problems_are_all_reported():
    found = reasons(LLAMA, V100, attention="fa2", precision="bf16-mixed")
    assert len(found) == 2


def test_default_precision_per_device():
    assert rules.default_precision(V100) == "fp16-mixed"
    assert rules.default_precision(A100) == "bf16-mixed"
    assert rules.default_precision(CPU) == "fp32"


def test_enumeration_holds_fixed_keys_and_pairs_qlora_storage():
    space = list(enumerate_strategies(FALCON, V100, seq_len=256, micro_batch_size=1, fixed={"method": "qlora"}))
    assert space and all(s.method == "qlora" and s.precision == "fp16-mixed" for s in space)
    assert all(s.lora_targets == ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h") for s in space)
    for s in space:
        assert s.quant_storage == ("fp16" if s.zero_stage == 3 or s.fsdp else "uint8")
    # every enumerated combination exists (the Strategy validator accepted it) and nothing repeats
    assert len({s.model_dump_json() for s in space}) == len(space)


def test_enumeration_size_and_restrictions():
    full = list(enumerate_strategies(LLAMA, A100, seq_len=512, micro_batch_size=1))
    # 4 methods x 2 gc x 3 attention x (DDP 1 + ZeRO-1/2 2x2 + ZeRO-3 3 + FSDP-SGO 2 + FSDP-full 3 offloads,
    # FSDP in both versions) x 2 losses (standard, chunked)
    assert len(full) == 4 * 2 * 3 * (1 + 4 + 3 + 2 * (2 + 3)) * 2
    assert {s.engine for s in full if s.fsdp} == {"fsdp-full_shard", "fsdp-shard_grad_op", "fsdp1-full_shard",
                                                  "fsdp1-shard_grad_op"}
    v1 = list(enumerate_strategies(LLAMA, A100, seq_len=512, micro_batch_size=1, fixed={"fsdp_version": 1}))
    assert {s.engine for s in v1 if s.fsdp} == {"fsdp1-full_shard", "fsdp1-shard_grad_op"}
    assert len(v1) == 4 * 2 * 3 * (1 + 4 + 3 + 2 + 3) * 2  # DDP / ZeRO kept; FSDP only as FSDP1
    assert {s.loss for s in full} == {"standard", "chunked"}
    held = list(enumerate_strategies(LLAMA, A100, seq_len=512, micro_batch_size=1, fixed={"loss": "chunked"}))
    assert len(held) == len(full) // 2 and {s.loss for s in held} == {"chunked"}
    restricted = list(enumerate_strategies(LLAMA, A100, seq_len=512, micro_batch_size=1, methods=["lora"],
                                           zero_stages=[2, 3], allow_offload=False))
    assert {s.engine for s in restricted} == {"zero2", "zero3"}
    assert {s.offload for s in restricted} == {"none"} and {s.method for s in restricted} == {"lora"}


@pytest.mark.parametrize("kwargs, needle", [
    (dict(methods=["lora", "ia3"]), "--methods: ia3 not allowed"),
    (dict(zero_stages=[4]), "--zero-stages: 4 not allowed"),
    (dict(seq_len=0), "seq_len=0: must be a positive integer"),
    (dict(fixed={"lora_rank": 4}), "lora_rank"),
])
def test_enumeration_bad_input(kwargs, needle):
    args = dict(seq_len=512, micro_batch_size=1) | kwargs
    with pytest.raises(ConfigError, match=needle):
        list(enumerate_strategies(LLAMA, A100, **args))


def test_make_strategy_names_the_field():
    with pytest.raises(ConfigError, match=r"strategy: zero_stage \(--zero\): got 5; should be less than or equal to 3"):
        make_strategy(zero_stage=5)
    with pytest.raises(ConfigError, match="offload='optimizer' is done by DeepSpeed ZeRO or FSDP"):
        make_strategy(offload="optimizer")


def test_one_device_skips_sharding_without_offload():
    one = parse_hardware("1xA100-80GB")
    space = list(enumerate_strategies(LLAMA, one, seq_len=512, micro_batch_size=1, methods=["lora"]))
    assert all(s.engine == "ddp" or s.offload != "none" for s in space)
    assert any(s.zero_stage == 3 and s.offload == "optimizer+params" for s in space)  # offload still searched
    asked = list(enumerate_strategies(LLAMA, one, seq_len=512, micro_batch_size=1, fixed={"zero_stage": 2}))
    assert any(s.zero_stage == 2 and s.offload == "none" for s in asked)  # unless the user asks for it


def test_meft_top_k_cannot_exceed_neurons():
    found = reasons(LLAMA, A100, method="meft", meft_neurons=32, meft_top_k=64)
    assert len(found) == 1 and "meft_top_k=64 exceeds meft_neurons=32" in found[0]


@pytest.mark.parametrize("fixed, zero_stages, engines", [
    ({"fsdp": "full_shard"}, None, {"fsdp-full_shard", "fsdp1-full_shard"}),  # the planner tries both versions
    ({"fsdp": "full_shard", "fsdp_version": 1}, None, {"fsdp1-full_shard"}),
    ({"fsdp": "full_shard", "fsdp_version": 2}, None, {"fsdp-full_shard"}),
    ({"fsdp": False}, [2, 3], {"zero2", "zero3"}),
    ({"zero_stage": 3}, None, {"zero3"}),
    ({"zero_stage": 0, "fsdp": False}, None, {"ddp"}),
    ({}, [0], {"ddp"}),
    ({"fsdp": "shard_grad_op"}, [2, 3], {"fsdp-shard_grad_op", "fsdp1-shard_grad_op"}),  # asking for FSDP
    # overrides the stage list
])
def test_fixed_engine_keys(fixed, zero_stages, engines):
    space = enumerate_strategies(LLAMA, A100, seq_len=512, micro_batch_size=1, fixed=fixed, zero_stages=zero_stages)
    assert {s.engine for s in space} == engines


def test_contradicting_engine_keys():
    with pytest.raises(ConfigError, match="two sharding engines"):
        list(enumerate_strategies(LLAMA, A100, seq_len=512, micro_batch_size=1,
                                  fixed={"zero_stage": 2, "fsdp": "full_shard"}))
    with pytest.raises(ConfigError, match="--zero 1 is not among --zero-stages 2,3"):
        list(enumerate_strategies(LLAMA, A100, seq_len=512, micro_batch_size=1, fixed={"zero_stage": 1},
                                  zero_stages=[2, 3]))


def test_rules_read_only_the_memo_key_fields():
    """The planner memoises rule verdicts by search.rule_key; varying any other field must not matter."""
    from memfit.plan.search import rule_key

    small = parse_hardware("1xA100-80GB", cpu_ram="8GB")
    others = dict(seq_len=8192, micro_batch_size=4, grad_accum=16, lora_r=256, lora_alpha=7, lora_dropout=0.3,
                  double_quant=False, meft_experts=3, meft_n_probe=2)
    for hw in (V100, CPU, small):
        for s in enumerate_strategies(LLAMA, hw, seq_len=512, micro_batch_size=1):
            for gc in (False, True):
                t = s.model_copy(update={**others, "gradient_checkpointing": gc})
                assert rule_key(t) == rule_key(s)
                assert rules.check(LLAMA, hw, t) == rules.check(LLAMA, hw, s)
