"""Model size × context length table of recommendations (like Figure 4 of arXiv 2406.02290).

``matrix(hardware, models, seq_lens, ...) -> Matrix``: one plan per cell, a compact label per cell
("LoRA+Z2", "LoRA+Z3+GC", "✗"). By default the search uses the levers of that study — full fine-tuning
or LoRA, DDP/ZeRO-1/2/3, gradient checkpointing, attention kernel, ZeRO-Offload of optimizer
states — and no QLoRA, MEFT, FSDP or parameter offload, so the table answers "what does the study's recipe
need here". Pass ``methods``/``offloads``/``zero_stages=None`` to widen it. A cell that fits on no pool of
``hardware``'s size may be retried on up to ``max_nodes`` nodes (Falcon-180B needs two 8xV100 nodes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from memfit.plan.search import Plan, plan

DEFAULT_MODELS: tuple[str, ...] = ("llama-2-7b", "llama-2-13b", "llama-2-70b", "falcon-180b")
DEFAULT_SEQ_LENS: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
STUDY_METHODS: tuple[str, ...] = ("full", "lora")
STUDY_OFFLOADS: tuple[str, ...] = ("none", "optimizer")
STUDY_ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)  # DDP and DeepSpeed ZeRO; no FSDP (the study used DeepSpeed)
NO_FIT = "✗"

_METHOD = {"full": "Full", "lora": "LoRA", "qlora": "QLoRA", "meft": "MEFT"}
_ENGINE = {"ddp": "DDP", "zero1": "Z1", "zero2": "Z2", "zero3": "Z3",
           "fsdp-full_shard": "FSDP", "fsdp-shard_grad_op": "FSDP-SGO",
           "fsdp1-full_shard": "FSDP1", "fsdp1-shard_grad_op": "FSDP1-SGO"}
_OFFLOAD = {"none": "", "optimizer": "Off", "optimizer+params": "OffP"}


def short_label(strategy: Any) -> str:
    """'LoRA+Z3+GC', 'Full+Z2+Off', 'QLoRA+FSDP+GC+FA2+OffP', 'LoRA+DDP+GC+CCE' (chunked cross-entropy);
    SDPA, the default kernel, is not named."""
    parts = [_METHOD[strategy.method], _ENGINE[strategy.engine]]
    if strategy.gradient_checkpointing:
        parts.append("GC")
    if strategy.attention != "sdpa":
        parts.append(strategy.attention.upper() if strategy.attention == "fa2" else "eager")
    if strategy.offload != "none":
        parts.append(_OFFLOAD[strategy.offload])
    if getattr(strategy, "loss", "standard") == "chunked":
        parts.append("CCE")
    # the long-context levers: a cell that needs one lies beyond the frontier without them (memfit.plan.longctx)
    if strategy.sequence_parallel > 1:
        parts.append(f"SP{strategy.sequence_parallel}")
    if strategy.context_parallel > 1:
        parts.append(f"CP{strategy.context_parallel}")
    if strategy.activation_offload != "none":
        parts.append("AO" if strategy.activation_offload == "checkpointed" else "AOall")
    if strategy.tiled_mlp:
        parts.append("TM")
    return "+".join(parts)


@dataclass
class Cell:
    model: str
    seq_len: int
    plan: Optional[Plan]
    nodes: int = 1

    @property
    def recommended(self) -> Any:
        return self.plan.recommended if self.plan is not None else None

    @property
    def label(self) -> str:
        rec = self.recommended
        if rec is None:
            return NO_FIT
        label = short_label(rec.strategy)
        return f"{label} ×{self.nodes}n" if self.nodes > 1 else label

    def to_dict(self) -> dict:
        rec = self.recommended
        return {"model": self.model, "seq_len": self.seq_len,
                "recommended": rec.to_dict() if rec is not None else None,
                "label": self.label, "nodes": self.nodes}


@dataclass
class Matrix:
    hardware: Any
    models: list[str]
    seq_lens: list[int]
    cells: list[Cell] = field(default_factory=list)

    def cell(self, model: str, seq_len: int) -> Cell:
        for c in self.cells:
            if c.model == model and c.seq_len == seq_len:
                return c
        raise KeyError((model, seq_len))

    def rows(self) -> list[list[str]]:
        """Labels, one row per model, one column per sequence length."""
        return [[self.cell(m, s).label for s in self.seq_lens] for m in self.models]

    def to_dict(self) -> dict:
        return {"hardware": self.hardware.text(), "cells": [c.to_dict() for c in self.cells]}


def matrix(
    hardware: Any,
    models: Iterable[Any] = DEFAULT_MODELS,
    seq_lens: Iterable[int] = DEFAULT_SEQ_LENS,
    *,
    methods: Optional[Iterable[str]] = STUDY_METHODS,
    offloads: Optional[Iterable[str]] = STUDY_OFFLOADS,
    zero_stages: Optional[Iterable[int]] = STUDY_ZERO_STAGES,
    micro_batch_size: int = 1,
    grad_accum: int = 1,
    margin: float = 0.05,
    profile: Any = None,
    fixed: Optional[dict[str, Any]] = None,
    max_nodes: Optional[int] = None,
    long_context: bool = True,
) -> Matrix:
    """Plan every (model, seq_len) cell on ``hardware``; cells that do not fit retry on more nodes."""
    from memfit.spec.model import resolve_model

    specs = [resolve_model(m) if isinstance(m, str) else m for m in models]
    seq_lens = list(seq_lens)
    base_nodes = hardware.nodes
    max_nodes = max(max_nodes or base_nodes, base_nodes)
    pools = {base_nodes: hardware}
    result = Matrix(hardware=hardware, models=[s.name for s in specs], seq_lens=seq_lens)
    kwargs = dict(methods=methods, offloads=offloads, zero_stages=zero_stages,
                  micro_batch_size=micro_batch_size, grad_accum=grad_accum, margin=margin,
                  profile=profile, fixed=fixed, explain=False, long_context=long_context)
    for spec in specs:
        memos: dict[int, dict] = {}  # rule verdicts per pool, shared across this model's sequence lengths
        for s in seq_lens:
            first = found = plan(spec, hardware, seq_len=s, rule_memo=memos.setdefault(base_nodes, {}), **kwargs)
            nodes = base_nodes
            while found.recommended is None and nodes < max_nodes:
                nodes += 1
                if nodes not in pools:
                    pools[nodes] = hardware.with_nodes(nodes)
                found = plan(spec, pools[nodes], seq_len=s, rule_memo=memos.setdefault(nodes, {}), **kwargs)
            if found.recommended is None:
                found, nodes = first, base_nodes
            result.cells.append(Cell(spec.name, s, found, nodes))
    return result
