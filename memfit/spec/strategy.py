"""The chosen optimizations of a run: one flat, validated object shared by plan, train and measure.

The keys are the contract of ``memfit estimate --json``'s ``strategy`` object and of the run file's
``strategy`` section, so ``--set strategy.gradient_checkpointing=true`` means the same everywhere.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memfit.methods import METHODS as _METHODS
from memfit.methods.lora.config import DEFAULT_LORA_TARGETS, LoraSettings
from memfit.methods.meft.config import MeftSettings
from memfit.methods.peft.config import PeftSettings
from memfit.methods.qlora.config import QLoraSettings, QuantStorage
Attention = Literal["eager", "sdpa", "fa2"]
Fsdp = Union[Literal[False], Literal["full_shard", "shard_grad_op"]]
FsdpVersion = Literal[1, 2]
Offload = Literal["none", "optimizer", "optimizer+params"]
Optimizer = Literal["adamw", "adamw8bit", "sgd"]
Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16"]
Loss = Literal["standard", "chunked"]
ActivationOffload = Literal["none", "checkpointed", "all"]
Allocator = Literal["default", "expandable_segments"]

ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "fa2")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+params")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw8bit", "sgd")
PRECISIONS: tuple[str, ...] = ("fp32", "fp16-mixed", "bf16-mixed", "bf16")
FSDP_MODES: tuple[str, ...] = ("full_shard", "shard_grad_op")
FSDP_VERSIONS: tuple[int, ...] = (1, 2)
LOSSES: tuple[str, ...] = ("standard", "chunked")
ACTIVATION_OFFLOADS: tuple[str, ...] = ("none", "checkpointed", "all")
# loss=chunked: tokens per chunk of the output projection + cross-entropy (memfit.train.loss). 256 rows keep
# the head's matmuls near compute-bound on GPUs (a 16-bit weight read once per 256 tokens) while one chunk's
# logits stay 256 x vocab (128k vocab: 394 MB at 12 B per logit instead of 12 B x tokens x vocab).
LOSS_CHUNK_TOKENS = 256


def loss_chunk_tokens(vocab: int, tokens: int) -> int:
    """Tokens per chunk of the chunked loss for ``tokens`` (= micro-batch x seq_len) flattened tokens."""
    return max(1, min(int(tokens), LOSS_CHUNK_TOKENS))


def liger_chunk_tokens(vocab: int, hidden: int, tokens: int) -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy (liger-kernel 0.8.5 ops/fused_linear_cross_entropy.py:
    ``inc_factor = cdiv(V, chunk_mem_const * H)`` with chunk_mem_const 1, ``chunk_size = next_power_of_2(cdiv(BT,
    inc_factor))``, at most BT): a chunk's logits about the size of the hidden states."""
    per = max(1, -(-int(tokens) // max(1, -(-vocab // hidden))))
    return max(1, min(int(tokens), 1 << (per - 1).bit_length()))


# the long-context levers (docs/long-context.md), each with its off value
LONG_CONTEXT_LEVERS = (("sequence_parallel", 1), ("context_parallel", 1), ("activation_offload", "none"),
                       ("tiled_mlp", False), ("liger", False))

__all__ = ["DEFAULT_LORA_TARGETS", "LONG_CONTEXT_LEVERS", "QuantStorage", "Strategy"]


class Levers(BaseModel):
    """The levers every method shares (the engine, checkpointing, attention, precision, the batch's shape)."""

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
    liger: bool = Field(False, description="Liger Kernel's Triton kernels as transformers' use_liger_kernel applies "
                        "them (CUDA GPUs): RMSNorm, the fused gate activation (SwiGLU / GeGLU), RoPE and the fused "
                        "linear cross-entropy, so the loss is chunked (loss: chunked, set for you)")
    allocator: Allocator = Field("default", description="the CUDA caching allocator's mode: default, or "
                                 "expandable_segments (memfit train sets PYTORCH_CUDA_ALLOC_CONF="
                                 "expandable_segments:True on CUDA): one growing segment per stream whose free "
                                 "pages are unmapped when the card fills, so no cached working sets are held "
                                 "(memfit.estimate.cuda.gap_parts). Ignored on the CPU")
    # long context (docs/long-context.md)
    sequence_parallel: int = Field(1, ge=1, description="Ulysses sequence parallelism: ranks that share one "
                                   "sequence, each holding seq_len / N of its tokens (an all-to-all around attention "
                                   "swaps sequence shards for head shards); DeepSpeed ZeRO through accelerate's "
                                   "ParallelismConfig(sp_size=N). 1: off")
    context_parallel: int = Field(1, ge=1, description="context parallelism: ranks that share one sequence, keys and "
                                  "values exchanged around attention (torch's context_parallel through accelerate's "
                                  "ParallelismConfig(cp_size=N), FSDP2 only). 1: off")
    activation_offload: ActivationOffload = Field("none", description="checkpointed: the checkpointed layers' inputs "
                                                  "kept in CPU memory (transformers' activation_checkpointing_enable("
                                                  "offload=True)); all: every tensor saved for backward (torch's "
                                                  "autograd.graph.save_on_cpu)")
    tiled_mlp: bool = Field(False, description="the MLP computed in sequence tiles of hidden_size tokens and "
                            "recomputed tile by tile in backward (DeepSpeed's TiledMLP)")


class Strategy(PeftSettings, MeftSettings, QLoraSettings, LoraSettings, Levers):
    """Every lever memfit can pull, with defaults a PEFT/TRL user would expect: the shared levers, then each
    method's own settings, which live in its folder (memfit/methods/<name>/config.py). The keys stay flat, in
    this order: the contract of ``estimate --json``'s strategy and the run file's ``strategy`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value not in _METHODS:
            names = [repr(m) for m in _METHODS]
            raise ValueError(", ".join(names[:-1]) + " or " + names[-1])
        return value

    @model_validator(mode="before")
    @classmethod
    def _version_only_with_fsdp(cls, data):
        # fsdp_version says which FSDP runs; without FSDP it means nothing, so one strategy has one form
        # (a run file or --set that turns FSDP off keeps working, and DDP/ZeRO never differ by it)
        if isinstance(data, dict) and not data.get("fsdp") and data.get("fsdp_version", 2) != 2:
            data = {**data, "fsdp_version": 2}
        if isinstance(data, dict) and data.get("liger") and "loss" not in data:
            data = {**data, "loss": "chunked"}  # Liger's fused linear cross-entropy never makes the whole logits
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
        if self.sequence_parallel > 1 and self.context_parallel > 1:
            raise ValueError(f"sequence_parallel={self.sequence_parallel} and context_parallel="
                             f"{self.context_parallel}: accelerate runs one of the two (ParallelismConfig); set the "
                             "other to 1")
        if self.liger and self.loss != "chunked":
            raise ValueError(f"liger=true computes the loss with Liger's fused linear cross-entropy (loss='chunked'), "
                             f"not loss={self.loss!r}: drop the loss setting or set liger=false")
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
        if self.liger:
            parts.append("liger")
        elif self.loss != "standard":
            parts.append(f"{self.loss}-ce")
        if self.allocator != "default":
            parts.append("expandable")
        if self.sequence_parallel > 1:
            parts.append(f"sp{self.sequence_parallel}")
        if self.context_parallel > 1:
            parts.append(f"cp{self.context_parallel}")
        if self.activation_offload != "none":
            parts.append(f"act-offload:{self.activation_offload}")
        if self.tiled_mlp:
            parts.append("tiled-mlp")
        return "+".join(parts)
