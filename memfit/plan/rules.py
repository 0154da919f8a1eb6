"""Combinations that cannot run at all, whatever the memory: the hardware or the engines lack them.

``check(model, hardware, strategy)`` returns one sentence per problem, each saying what is wrong and
what to change. An empty list means the combination can run (whether it *fits* is the estimator's
question). The planner uses it to prune its search and the training pre-flight calls it before loading
anything, so keep the signature. The planner memoises verdicts by the fields in
``memfit.plan.search.rule_key``: a new rule that reads another strategy field must add it there.
"""

from __future__ import annotations

from typing import Any, Callable

from memfit.methods import METHODS
from memfit.methods.base import matched_linears
from memfit.spec import context
from memfit.spec.strategy import Strategy

Rule = Callable[[Any, Any, Strategy], "str | None"]


def _context(model: Any, hw: Any, s: Strategy) -> str | None:
    """Learned absolute positions end at their table (memfit.spec.context; RoPE past its length: a note)."""
    return context.refusal(model, s.seq_len)


def _attention(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.attention != "fa2":
        return None
    if hw.gpu.is_cpu:
        return ("attention=fa2: FlashAttention-2 needs a CUDA GPU (Ampere or newer) and does not run on "
                "the CPU; use attention=sdpa")
    if not hw.gpu.fa2:
        return (f"attention=fa2: {hw.gpu.name} has no FlashAttention-2 support (it needs Ampere "
                "or newer; V100 and T4 do not qualify); use attention=sdpa")
    if s.precision == "fp32":
        return ("attention=fa2 with precision=fp32: FlashAttention-2 computes only in fp16/bf16; use "
                "precision=bf16-mixed (or fp16-mixed), or attention=sdpa")
    return None


def _precision(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.precision in ("bf16", "bf16-mixed") and not (hw.gpu.is_cpu or hw.gpu.bf16):
        return (f"precision={s.precision}: {hw.gpu.name} has no bf16 support; use "
                "precision=fp16-mixed (or fp32)")
    if s.precision == "fp16-mixed" and hw.gpu.is_cpu:
        return ("precision=fp16-mixed on the CPU: CPU autocast and loss scaling support bf16, not fp16; "
                "use precision=fp32 or bf16-mixed")
    return None


def _offload(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.offload == "none":
        return None
    if hw.gpu.is_cpu:
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


def _fsdp_version(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.fsdp and getattr(s, "fsdp_version", 2) == 1 and hw.gpu.is_cpu:
        return ("fsdp_version=1 on the CPU device: FSDP1's final full-state-dict gather crashes under gloo "
                "(docs/distributed.md); use fsdp_version=2 on the CPU, FSDP1 on CUDA GPUs, or train with "
                "save.mode=sharded or adapter")
    return None


def _sequence_parallel(model: Any, hw: Any, s: Strategy) -> str | None:
    """Ulysses (deepspeed 0.19.8 runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF, through accelerate
    1.15's ParallelismConfig with sp_backend='deepspeed')."""
    n = s.sequence_parallel
    if n == 1:
        return None
    if not s.zero_stage:
        return (f"sequence_parallel={n}: Ulysses runs under DeepSpeed ZeRO only (accelerate's sp_backend="
                "'deepspeed'); set zero_stage=1, 2 or 3")
    if s.attention == "eager":
        return (f"sequence_parallel={n} with attention=eager: Ulysses does not take eager attention (its 4D mask "
                "is O(seq²); ulysses_sp.py); use attention=sdpa or fa2")
    if hw.world_size % n:
        return (f"sequence_parallel={n} does not divide the {hw.world_size} processes: use a divisor of "
                f"{hw.world_size}")
    if model.heads % n:
        return (f"sequence_parallel={n}: {model.name}'s {model.heads} attention heads are not divisible by {n} "
                "(each rank computes heads / N of them); use a divisor of the head count")
    if model.kv_heads % n and n % model.kv_heads:
        return (f"sequence_parallel={n}: {model.name}'s {model.kv_heads} key/value heads neither divide by {n} "
                "nor divide it (Ulysses shards or replicates them); use a divisor or multiple of the KV heads")
    if s.seq_len % n:
        return f"sequence_parallel={n}: seq_len={s.seq_len} is not divisible by {n}; pad to a multiple of {n}"
    return None


def _context_parallel(model: Any, hw: Any, s: Strategy) -> str | None:
    """torch.distributed.tensor.experimental.context_parallel through accelerate 1.15 (cp_backend='torch'): FSDP2
    only; it intercepts the CUDA flash and memory-efficient SDPA kernels; the sequence is split into 2N chunks
    (load balancing of the causal mask)."""
    n = s.context_parallel
    if n == 1:
        return None
    if not s.fsdp or s.fsdp_version != 2:
        return f"context_parallel={n}: torch's context parallelism runs with FSDP2 only; set fsdp and fsdp_version=2"
    if hw.gpu.is_cpu or s.attention == "eager":
        return (f"context_parallel={n}: torch intercepts only the CUDA flash / memory-efficient attention kernels; "
                "use attention=sdpa or fa2 on CUDA GPUs")
    if hw.world_size % n:
        return (f"context_parallel={n} does not divide the {hw.world_size} processes: use a divisor of "
                f"{hw.world_size}")
    if s.seq_len % (2 * n):
        return (f"context_parallel={n}: seq_len={s.seq_len} is not divisible by {2 * n} (2 x N load-balanced "
                f"chunks); pad to a multiple of {2 * n}")
    return None


def _activation_offload(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.activation_offload == "checkpointed" and not s.gradient_checkpointing:
        return ("activation_offload=checkpointed moves the checkpointed layers' inputs: it needs "
                "gradient_checkpointing=true (or use activation_offload=all)")
    return None


def _tiled_mlp(model: Any, hw: Any, s: Strategy) -> str | None:
    if s.tiled_mlp and not s.zero_stage:
        return ("tiled_mlp: DeepSpeed's TiledMLP is installed under DeepSpeed ZeRO only; set zero_stage=1, 2 or 3 "
                "(or tiled_mlp=false)")
    return None


# the model types liger-kernel 0.8.5 patches (liger_kernel/transformers/monkey_patch.py
# MODEL_TYPE_TO_APPLY_LIGER_FN), which transformers' use_liger_kernel looks the model up in
LIGER_MODEL_TYPES = frozenset((
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text",
    "gemma4", "gemma4_text", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "granite", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "internvl", "llama", "llama4", "llama4_text", "llava", "ministral", "mistral", "mixtral",
    "mllama", "mllama_text_model", "muse_glimmer", "nemotron", "olmo2", "olmo3", "paligemma", "phi3", "pixtral",
    "qwen2", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text", "qwen3", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "qwen3_vl_text", "smollm3", "smolvlm"))


def _liger(model: Any, hw: Any, s: Strategy) -> str | None:
    if not s.liger:
        return None
    if hw.gpu.is_cpu:
        return ("liger=true: Liger Kernel's kernels are Triton kernels for GPUs; the CPU device cannot run them "
                "(estimate it for a GPU pool, or set liger=false)")
    if model.family not in LIGER_MODEL_TYPES:
        return (f"liger=true: Liger Kernel 0.8.5 patches no {model.family!r} model (llama, mistral, mixtral, qwen2, "
                "qwen3, gemma, phi3, granite, ...); set liger=false")
    return None


def _method(model: Any, hw: Any, s: Strategy) -> list[str]:
    """The method's own rules (memfit.methods: LoRA targets, QLoRA storage, MEFT engines and CPU store)."""
    return METHODS[s.method].rules(model, hw, s)


RULES: tuple[Rule, ...] = (_context, _attention, _precision, _offload, _fsdp_version, _sequence_parallel,
                           _context_parallel, _activation_offload, _tiled_mlp, _liger)


def check(model: Any, hardware: Any, strategy: Strategy) -> list[str]:
    """Reasons ``strategy`` cannot run ``model`` on ``hardware`` at all; [] when it can."""
    reasons = [r for r in (rule(model, hardware, strategy) for rule in RULES) if r]
    return reasons + _method(model, hardware, strategy)


def default_precision(hardware: Any) -> str:
    """What the planner trains in: fp32 on the CPU, bf16-mixed where the GPU has bf16, else fp16-mixed."""
    if hardware.gpu.is_cpu:
        return "fp32"
    return "bf16-mixed" if hardware.gpu.bf16 else "fp16-mixed"


def default_lora_targets(model: Any, requested: tuple[str, ...]) -> tuple[str, ...]:
    """``requested`` if the model has those layers, else the model's own attention+MLP linears."""
    names = model.linear_names()
    if not names or matched_linears(names, requested):
        return tuple(requested)
    return tuple(names)
