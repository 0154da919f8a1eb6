"""The long-context levers in the planner's search (docs/long-context.md): where no combination fits as is, the
planner tries again with the levers that divide or move the sequence's memory — Ulysses sequence parallelism
(DeepSpeed ZeRO), context parallelism (FSDP2 on CUDA), activation offloading and the tiled MLP (ZeRO) — on
the same combinations, each degree a power of two up to the pool (the rules in memfit.plan.rules prune what an
engine or the model's heads do not allow). Levers the user fixed are held."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

from pydantic import ValidationError

from memfit.spec.strategy import Strategy

LEVER_KEYS = ("sequence_parallel", "context_parallel", "activation_offload", "tiled_mlp")


def _degrees(world: int) -> list[int]:
    out, d = [], 2
    while d <= world:
        if world % d == 0:
            out.append(d)
        d *= 2
    return out


def variants(strategies: Iterable[Strategy], hardware: Any, fixed: Optional[dict]) -> Iterator[Strategy]:
    """The combinations again with the long-context levers (none of them where the user fixed one)."""
    fixed = fixed or {}
    if any(k in fixed for k in LEVER_KEYS):
        return
    degrees = _degrees(hardware.world_size)
    cuda = not hardware.gpu.is_cpu
    for s in strategies:
        if s.attention == "eager":
            continue  # neither Ulysses nor context parallelism take it; offloading alone rarely rescues s²
        zero, fsdp2 = s.zero_stage > 0, bool(s.fsdp) and s.fsdp_version == 2
        splits = [{}] + [{"sequence_parallel": d} for d in degrees if zero] + \
            [{"context_parallel": d} for d in degrees if fsdp2 and cuda]
        offloads = ("none", "checkpointed") if s.gradient_checkpointing and cuda else ("none",)
        tiles = (False, True) if zero else (False,)
        for split in splits:
            for offload in offloads:
                for tiled in tiles:
                    if not split and offload == "none" and not tiled:
                        continue  # the combination as tried already
                    try:
                        yield s.model_copy(update=dict(split, activation_offload=offload, tiled_mlp=tiled))
                    except ValidationError:
                        continue


def lever_note(plan: Any) -> Optional[str]:
    """When the recommendation uses a long-context lever: what it does and what the combination needs without."""
    rec = plan.recommended
    if rec is None:
        return None
    s = rec.strategy
    used = []
    if s.sequence_parallel > 1:
        used.append(f"Ulysses sequence parallelism over {s.sequence_parallel} GPUs (--sequence-parallel "
                    f"{s.sequence_parallel}: each holds {s.seq_len // s.sequence_parallel} of the {s.seq_len} tokens)")
    if s.context_parallel > 1:
        used.append(f"context parallelism over {s.context_parallel} GPUs (--context-parallel {s.context_parallel})")
    if s.activation_offload != "none":
        host = rec.cpu.get("offloaded_activations", 0.0) / 1e9
        used.append(f"activation offloading ({s.activation_offload}: {host:.0f} GB of pinned CPU RAM per node)")
    if s.tiled_mlp:
        used.append("the tiled MLP")
    if not used:
        return None
    base = s.model_copy(update={k: Strategy.model_fields[k].default for k in LEVER_KEYS})
    twin = next((r for r in plan.rejected if r.estimate is not None and r.strategy == base), None)
    pronoun = "them" if len(used) > 1 else "it"
    without = f"; without {pronoun} the same combination needs {twin.estimate.gpu_needed / 1e9:.1f} GB per GPU" \
        if twin is not None else ""
    verb = "make" if len(used) > 1 else "makes"
    return f"No combination fits {s.seq_len} tokens as is: {', '.join(used)} {verb} it fit{without}."
