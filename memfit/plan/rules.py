"""Combinations that cannot run at all, whatever the memory: the hardware or the engines lack them.

``check(model, hardware, strategy)`` returns one sentence per problem, each saying what is wrong and
what to change. An empty list means the combination can run (whether it *fits* is the estimator's
question). The planner uses it to prune its search and the training pre-flight calls it before loading
anything, so keep the signature. The planner memoises verdicts by the fields in
``memfit.plan.search.rule_key``: a new rule that reads another strategy field must add it there.
"""

from __future__ import annotations

from typing import Any, Callable

from memfit.plan import facts
from memfit.spec.strategy import Strategy

# The dtype FSDP / ZeRO-3 flatten parameters to, per precision: QLoRA's quant storage must equal it.
PARAM_DTYPE = {"bf16-mixed": "bf16", "bf16": "bf16", "fp16-mixed": "fp16", "fp32": "fp32"}

# MEFT keeps fp32 keys/values, their gradients and Adam's two moments in CPU memory.
MEFT_CPU_BYTES_PER_PARAM = 16

Rule = Callable[[Any, Any, Strategy], "str | None"]


def _attention(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.attention != "fa2":
        return None
    if facts.is_cpu(hw):
        return ("attention=fa2: FlashAttention-2 needs a CUDA GPU (Ampere or newer) and does not run on "
                "the CPU; use attention=sdpa")
    if not facts.supports_fa2(hw):
        return (f"attention=fa2: {facts.gpu_name(hw)} has no FlashAttention-2 support (it needs Ampere "
                "or newer; V100 and T4 do not qualify); use attention=sdpa")
    if s.precision == "fp32":
        return ("attention=fa2 with precision=fp32: FlashAttention-2 computes only in fp16/bf16; use "
                "precision=bf16-mixed (or fp16-mixed), or attention=sdpa")
    return None


def _precision(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.precision in ("bf16", "bf16-mixed") and not facts.supports_bf16(hw):
        return (f"precision={s.precision}: {facts.gpu_name(hw)} has no bf16 support; use "
                "precision=fp16-mixed (or fp32)")
    if s.precision == "fp16-mixed" and facts.is_cpu(hw):
        return ("precision=fp16-mixed on the CPU: CPU autocast and loss scaling support bf16, not fp16; "
                "use precision=fp32 or bf16-mixed")
    return None


def _qlora(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.method != "qlora":
        return None
    sharded = s.zero_stage == 3 or s.fsdp in ("full_shard", "shard_grad_op")
    # (QLoRA under ZeRO-3 / FSDP2 also runs on the CPU device with gloo: tests/test_distributed_train.py)
    want = PARAM_DTYPE[s.precision]
    if sharded and s.quant_storage != want:
        engine = "ZeRO-3" if s.zero_stage == 3 else f"FSDP {s.fsdp}"
        return (f"method=qlora with {engine}: the 4-bit weights must be stored in the dtype the engine "
                f"flattens parameters to ({want} for precision={s.precision}), got "
                f"quant_storage={s.quant_storage}; set quant_storage={want}")
    if s.zero_stage == 3 and s.offload == "optimizer+params":
        return ("method=qlora with ZeRO-3 parameter offload: DeepSpeed cannot offload bitsandbytes 4-bit "
                "parameters; use fsdp=full_shard with offload=optimizer+params, or offload=optimizer")
    return None


def _meft(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.method != "meft":
        return None
    if s.zero_stage or s.fsdp:
        return (f"method=meft with {s.engine}: MEFT keeps its adapter and optimizer in CPU memory and "
                "updates them with its own CPU Adam, so it runs with plain DDP only; set zero_stage=0 "
                "and fsdp=false")
    if s.meft_top_k > s.meft_neurons:
        return (f"method=meft: meft_top_k={s.meft_top_k} exceeds meft_neurons={s.meft_neurons} (a token cannot "
                "activate more neurons than exist); lower --meft-top-k or raise --meft-neurons")
    if s.optimizer != "adamw":
        return (f"method=meft with optimizer={s.optimizer}: MEFT's CPU-resident adapter is updated by a "
                "CPU AdamW; use optimizer=adamw")
    ram = facts.cpu_ram_bytes(hw)
    h, layers = facts.hidden_size(model), facts.num_layers(model)
    if ram and h and layers:
        ranks = facts.gpus_per_node(hw)  # each process keeps its own store (NxCPU pools share one RAM)
        need = 2 * h * s.meft_neurons * layers * MEFT_CPU_BYTES_PER_PARAM * ranks
        if need > ram:
            return (f"method=meft: the CPU store of {s.meft_neurons} neurons x {layers} layers needs "
                    f"{need / 1e9:.1f} GB of CPU RAM per node ({ranks} process(es)), the node has "
                    f"{ram / 1e9:.1f} GB; lower meft_neurons or give more --cpu-ram")
    return None


def _offload(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.offload == "none":
        return None
    if facts.is_cpu(hw):
        return (f"offload={s.offload} on the CPU device: everything already lives in CPU memory; "
                "use offload=none")
    if s.fsdp and s.offload == "optimizer":
        return ("offload=optimizer with FSDP: FSDP's CPU offload moves parameters, gradients and optimizer "
                "state together; use offload=optimizer+params with fsdp=full_shard, or DeepSpeed ZeRO "
                "(zero_stage>=1) for optimizer-only offload")
    if s.optimizer == "adamw8bit":
        return ("optimizer=adamw8bit with offload: bitsandbytes' 8-bit optimizers need their states on "
                "the GPU; use optimizer=adamw with offload, or offload=none")
    if s.zero_stage and s.optimizer == "sgd":
        return ("optimizer=sgd with DeepSpeed offload: ZeRO-Offload steps on the CPU with its CPU Adam; "
                "use optimizer=adamw, or offload=none")
    return None


def _lora_targets(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.method not in ("lora", "qlora"):
        return None
    names = facts.linear_names(model)
    if not names or s.lora_targets == ("all-linear",):
        return None
    wanted = {t.rsplit(".", 1)[-1] for t in s.lora_targets}
    if not wanted & set(names):
        return (f"lora_targets={','.join(s.lora_targets)}: {facts.model_name(model)} has no such layer; "
                f"its linear layers are {','.join(names)} (set --lora-targets to some of them, or all-linear)")
    return None


RULES: tuple[Rule, ...] = (_attention, _precision, _qlora, _meft, _offload, _lora_targets)


def check(model: Any, hardware: Any, strategy: Strategy) -> list[str]:
    """Reasons ``strategy`` cannot run ``model`` on ``hardware`` at all; [] when it can."""
    reasons = []
    for rule in RULES:
        reason = rule(model, hardware, strategy)
        if reason:
            reasons.append(reason)
    return reasons


def default_precision(hardware: Any) -> str:
    """What the planner trains in: fp32 on the CPU, bf16-mixed where the GPU has bf16, else fp16-mixed."""
    if facts.is_cpu(hardware):
        return "fp32"
    return "bf16-mixed" if facts.supports_bf16(hardware) else "fp16-mixed"


def default_lora_targets(model: Any, requested: tuple[str, ...]) -> tuple[str, ...]:
    """``requested`` if the model has those layers, else the model's own attention+MLP linears."""
    names = facts.linear_names(model)
    if not names or {t.rsplit(".", 1)[-1] for t in requested} & set(names):
        return tuple(requested)
    return tuple(names)
