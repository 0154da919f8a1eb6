"""The chosen optimizations of a run: one flat, validated object shared by plan, train and measure.

The keys are the contract of ``memfit estimate --json``'s ``strategy`` object and of the run file's
``strategy`` section, so ``--set strategy.gradient_checkpointing=true`` means the same everywhere.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from memfit.methods import METHODS as _METHODS
from memfit.methods.peft.config import canonical as _peft_canonical
Attention = Literal["eager", "sdpa", "fa2"]
Fsdp = Union[Literal[False], Literal["full_shard", "shard_grad_op"]]
FsdpVersion = Literal[1, 2]
Offload = Literal["none", "optimizer", "optimizer+params"]
Optimizer = Literal["adamw", "adamw8bit", "sgd"]
Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16"]
QuantStorage = Literal["uint8", "bf16", "fp16", "fp32"]
Loss = Literal["standard", "chunked"]
Allocator = Literal["default", "expandable_segments"]

ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "fa2")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+params")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw8bit", "sgd")
PRECISIONS: tuple[str, ...] = ("fp32", "fp16-mixed", "bf16-mixed", "bf16")
FSDP_MODES: tuple[str, ...] = ("full_shard", "shard_grad_op")
FSDP_VERSIONS: tuple[int, ...] = (1, 2)
LOSSES: tuple[str, ...] = ("standard", "chunked")
# loss=chunked: tokens per chunk of the output projection + cross-entropy (memfit.train.loss). 256 rows keep
# the head's matmuls near compute-bound on GPUs (a 16-bit weight read once per 256 tokens) while one chunk's
# logits stay 256 x vocab (128k vocab: 394 MB at 12 B per logit instead of 12 B x tokens x vocab).
LOSS_CHUNK_TOKENS = 256


def loss_chunk_tokens(vocab: int, tokens: int) -> int:
    """Tokens per chunk of the chunked loss for ``tokens`` (= micro-batch x seq_len) flattened tokens."""
    return max(1, min(int(tokens), LOSS_CHUNK_TOKENS))

DEFAULT_LORA_TARGETS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)


class Strategy(BaseModel):
    """Every lever memfit can pull, with defaults a PEFT/TRL user would expect."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = Field("lora", description="a method of the registry memfit.methods.METHODS")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage; 0 = plain DDP")
    fsdp: Fsdp = False
    fsdp_version: FsdpVersion = Field(2, description="1: FullyShardedDataParallel (FlatParameter, accelerate's "
                                      "FSDP plugin as accelerate/fms-hf-tuning/Answer.AI configure it); 2: "
                                      "fully_shard. Without fsdp it is ignored (always 2)")
    fsdp_sync_each_batch: bool = Field(True, description="FSDP with grad_accum > 1: reduce-scatter every "
                                       "micro-batch, so gradients stay sharded (memfit's trainer sets accelerate's "
                                       "sync_each_batch; torchtune and torchtitan do the same); false: the HF "
                                       "Trainer's default no_sync, every gradient kept unsharded until the last "
                                       "micro-batch (one reduce-scatter per step, a whole model's gradients of "
                                       "memory). Without FSDP or accumulation it is ignored (always true)")
    offload: Offload = "none"
    gradient_checkpointing: bool = False
    hf_legacy_checkpoint: bool = Field(False, description="with gradient_checkpointing: the checkpoint "
                                       "transformers < 4.52 applies (the model calls torch's reentrant checkpoint, "
                                       "its default then, around each decoder layer: outside an FSDP unit "
                                       "wrapping that layer; fms-hf-tuning and TRL runs of 2024). Under FSDP1 it "
                                       "keeps every layer's input and its gradient to the backward's end "
                                       "(memfit.estimate.fsdp1). Planning only: memfit's trainer "
                                       "(transformers 5) checkpoints inside each layer, non-reentrant. Without "
                                       "checkpointing it is ignored (always false)")
    attention: Attention = "sdpa"
    optimizer: Optimizer = "adamw"
    precision: Precision = "bf16-mixed"
    micro_batch_size: int = Field(1, ge=1)
    grad_accum: int = Field(1, ge=1)
    seq_len: int = Field(512, ge=1)
    loss: Loss = Field("standard", description="chunked: output projection + cross-entropy over token chunks, "
                       "recomputed in backward (memfit.train.loss); never the full [tokens, vocab] logits")
    allocator: Allocator = Field("default", description="the CUDA caching allocator's mode: default, or "
                                 "expandable_segments (memfit train sets PYTORCH_CUDA_ALLOC_CONF="
                                 "expandable_segments:True on CUDA): one growing segment per stream whose free "
                                 "pages are unmapped when the card fills, so no cached working sets are held "
                                 "(memfit.estimate.cuda.gap_parts). Ignored on the CPU")
    # LoRA / QLoRA adapter
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0)
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    lora_rslora: bool = Field(False, description="rank-stabilised LoRA: scale by alpha/sqrt(r) (PEFT use_rslora)")
    lora_modules_to_save: tuple[str, ...] = Field((), description="modules trained whole beside the adapters "
                                                  "(PEFT modules_to_save), e.g. embed_tokens, lm_head")
    lora_rank_pattern: tuple[tuple[str, int], ...] = Field((), description="per-module ranks (PEFT rank_pattern)")
    lora_alpha_pattern: tuple[tuple[str, int], ...] = Field((), description="per-module alphas (PEFT alpha_pattern)")
    # QLoRA base-model quantisation (NF4)
    quant_storage: QuantStorage = "uint8"
    double_quant: bool = True
    # MEFT sparse adapter (see memfit.meft)
    meft_neurons: int = Field(8192, ge=1)
    meft_top_k: int = Field(64, ge=1)
    meft_experts: Union[int, Literal["auto"]] = "auto"
    meft_n_probe: int = Field(8, ge=1)
    meft_buffer_size: Optional[int] = Field(None, ge=1, description="device rows per layer for the batch's "
                                            "union of active neurons; None = max(top_k, neurons/4)")
    # method=peft: the PEFT config (adapter_config.json's keys) as canonical JSON text; the run file's
    # ``peft_config:`` block (a mapping, or the path of an adapter_config.json) folds into it
    peft_config: Optional[str] = None

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value not in _METHODS:
            names = [repr(m) for m in _METHODS]
            raise ValueError(", ".join(names[:-1]) + " or " + names[-1])
        return value

    @field_validator("lora_targets", "lora_modules_to_save", mode="before")
    @classmethod
    def _one_name(cls, value):
        return (value,) if isinstance(value, str) else value  # lora.targets: all-linear

    @field_validator("lora_rank_pattern", "lora_alpha_pattern", mode="before")
    @classmethod
    def _pattern_pairs(cls, value):
        # a mapping {module name or regex: value} as PEFT takes it; kept as sorted pairs (hashable)
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{k}: {v!r} is not a positive integer; give {{module name: rank}}, "
                                     "e.g. {q_proj: 32}")
            return tuple(sorted((str(k), int(v)) for k, v in value.items()))
        return value

    @field_serializer("lora_rank_pattern", "lora_alpha_pattern")
    def _pattern_mapping(self, value):
        return dict(value)  # written as PEFT writes it: {module: value}

    @field_validator("peft_config", mode="before")
    @classmethod
    def _peft_config_text(cls, value):
        return None if value is None else _peft_canonical(value)

    @model_validator(mode="before")
    @classmethod
    def _version_only_with_fsdp(cls, data):
        # fsdp_version says which FSDP runs; without FSDP it means nothing, so one strategy has one form
        # (a run file or --set that turns FSDP off keeps working, and DDP/ZeRO never differ by it)
        if isinstance(data, dict) and not data.get("fsdp") and data.get("fsdp_version", 2) != 2:
            data = {**data, "fsdp_version": 2}
        if isinstance(data, dict) and data.get("hf_legacy_checkpoint") and not data.get("gradient_checkpointing"):
            data = {**data, "hf_legacy_checkpoint": False}  # the checkpoint's kind means nothing without it
        # likewise fsdp_sync_each_batch: it decides something only under FSDP with accumulation
        if isinstance(data, dict) and "fsdp_sync_each_batch" in data and (
                not data.get("fsdp") or int(data.get("grad_accum", 1) or 1) <= 1):
            data = {**data, "fsdp_sync_each_batch": True}
        return data

    @model_validator(mode="after")
    def _one_engine(self) -> "Strategy":
        if self.fsdp and self.zero_stage:
            raise ValueError(
                f"zero_stage={self.zero_stage} and fsdp={self.fsdp!r} are two sharding engines; "
                "choose one (set zero_stage=0 to use FSDP, or fsdp=false to use DeepSpeed)"
            )
        if self.offload == "optimizer+params" and not (self.zero_stage == 3 or self.fsdp == "full_shard"):
            raise ValueError(
                "offload='optimizer+params' needs parameters sharded: use zero_stage=3 or "
                "fsdp='full_shard' (or offload='optimizer')"
            )
        if self.offload != "none" and not (self.zero_stage or self.fsdp):
            raise ValueError(
                f"offload={self.offload!r} is done by DeepSpeed ZeRO or FSDP: set zero_stage>=1 "
                "or fsdp, or use offload='none'"
            )
        if self.meft_experts != "auto" and self.meft_experts < 1:
            raise ValueError("meft_experts must be 'auto' or a positive integer")
        if self.meft_buffer_size is not None and self.meft_buffer_size < self.meft_top_k:
            raise ValueError(f"meft_buffer_size={self.meft_buffer_size} is below meft_top_k={self.meft_top_k}: "
                             "the buffer must hold at least one token's neurons; raise it or leave it unset")
        if (self.method == "peft") != (self.peft_config is not None):
            raise ValueError("method=peft reads a peft_config (a mapping of PEFT config keys, or the path of an "
                             "adapter_config.json) and no other method does: set both or neither")
        return self

    @property
    def engine(self) -> str:
        """'ddp', 'zero1'..'zero3', 'fsdp-full_shard' / 'fsdp-shard_grad_op' (FSDP2), or
        'fsdp1-full_shard' / 'fsdp1-shard_grad_op' (FSDP1)."""
        if self.fsdp:
            return f"fsdp{'1' if self.fsdp_version == 1 else ''}-{self.fsdp}"
        return f"zero{self.zero_stage}" if self.zero_stage else "ddp"

    @property
    def trains_adapter(self) -> bool:
        return not _METHODS[self.method].trains_base

    def label(self) -> str:
        """A short human name, e.g. 'lora+zero2+gc+sdpa'."""
        parts = [self.method, self.engine]
        if self.gradient_checkpointing:
            parts.append("gc-hf-legacy" if self.hf_legacy_checkpoint else "gc")
        parts.append(self.attention)
        if self.offload != "none":
            parts.append(f"offload:{self.offload}")
        if not self.fsdp_sync_each_batch:
            parts.append("no-sync")
        if self.loss != "standard":
            parts.append(f"{self.loss}-ce")
        if self.allocator != "default":
            parts.append("expandable")
        return "+".join(parts)
