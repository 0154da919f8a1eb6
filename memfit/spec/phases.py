"""Run phases beyond the training step (plain Python, no torch): how a run evaluates and saves.

Run-file keys ``eval: {batch_size, loss_only, accumulation_steps, examples}`` and ``save: {mode}``; their defaults
are what ``memfit train`` does (memfit/train/trainer.py, memfit/train/api.py), so a plan prices the run as it will
go. The estimator's run phases (load, training step, evaluation, checkpoint save) read them
(:mod:`memfit.estimate.phases`).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

SaveMode = Literal["sharded", "full", "adapter"]


class EvalSpec(BaseModel):
    """The evaluation loop (transformers 5.24 ``Trainer.evaluate`` / ``evaluation_loop``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = Field(True, description="false: the run evaluates nothing (no evaluation data, as memfit train "
                          "without data.eval) and the phase is not priced")
    batch_size: Optional[int] = Field(None, ge=1, description="sequences per GPU per evaluation batch; null = the "
                                      "training micro-batch (memfit train's per_device_eval_batch_size)")
    loss_only: bool = Field(True, description="the loss alone (Trainer.evaluate passes prediction_loss_only=True "
                            "when no compute_metrics is given, as memfit train does); false: every batch's logits "
                            "are gathered from all ranks and kept on the GPU (transformers#12878, #8476)")
    accumulation_steps: Optional[int] = Field(None, ge=1, description="with loss_only=false: batches whose logits "
                                              "stay on the GPU before moving to the CPU (eval_accumulation_steps); "
                                              "null = all of them")
    examples: Optional[int] = Field(None, ge=1, description="evaluation sequences in all (with loss_only=false and "
                                    "no accumulation_steps: the logits of all of them stay on the GPU)")


class SaveSpec(BaseModel):
    """How the trained weights are saved (the final save; checkpoints on ``training.checkpoint_interval``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: Optional[SaveMode] = Field(None, description="full: the whole state dict gathered on rank 0 (FSDP "
                                     "FULL_STATE_DICT, DeepSpeed's 16-bit gather); sharded: each rank writes its "
                                     "own shards; adapter: the trained parameters only; null = what memfit train "
                                     "does for the engine and method (save_mode)")


class RunPhases(BaseModel):
    """The keys the run phases read, together (``estimate(..., phases=...)``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    eval: EvalSpec = EvalSpec()
    save: SaveSpec = SaveSpec()


DEFAULT_PHASES = RunPhases()


def save_mode(strategy, mode: Optional[str] = None) -> str:
    """The save ``mode`` resolved for ``strategy``: memfit train's final save when none is given.

    memfit/train/api.py ``_save_final`` asks the engine for its gathered state dict
    (memfit/distributed/engines): FSDP (both versions) ``accelerator.get_state_dict`` — a full state dict on rank
    0 (accelerate 1.15 ``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)``), adapters included; ZeRO-3
    with an adapter method gathers the adapter alone (``exclude_frozen_parameters=True``), with full fine-tuning
    the whole 16-bit model; DDP and ZeRO-1/2 hold whole tensors and save the method's output (PEFT: the adapter)."""
    if mode is not None:
        return mode
    adapter = bool(strategy.trains_adapter)
    if strategy.fsdp:
        return "full"
    return "adapter" if adapter else "full"
