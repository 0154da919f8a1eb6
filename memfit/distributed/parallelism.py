"""Sequence and context parallelism as accelerate 1.15 runs them: ``ParallelismConfig`` for the Trainer.

- ``strategy.sequence_parallel: N`` (Ulysses / ALST): ``ParallelismConfig(sp_size=N, sp_backend="deepspeed")``
  (accelerate/parallelism_config.py:33). accelerate's DeepSpeed prepare (accelerate/accelerator.py:2394-2450)
  calls DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` (deepspeed/runtime/sequence_parallel/
  ulysses_sp.py:396), which builds the SP groups (parallel_state_sp.initialize_sequence_parallel) and replaces the
  model's attention function by an all-to-all around it; the Trainer wraps its train dataloader in
  ``UlyssesSPDataLoaderAdapter`` (transformers/trainer.py:1805, ulysses_sp.py:571), which shards each batch's
  tokens over the SP ranks, and computes the loss over them (transformers/integrations/deepspeed.py:721).
- ``strategy.context_parallel: N``: ``ParallelismConfig(cp_size=N, dp_shard_size=world / N)`` under FSDP2
  (accelerate/state.py:998: CP needs the FSDP plugin); the Trainer then runs each step inside
  ``accelerator.maybe_context_parallel`` (transformers/trainer.py:2416, accelerate/accelerator.py:4175), torch's
  ``context_parallel``, which intercepts the CUDA flash / memory-efficient SDPA kernels only.

torch and accelerate are imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from memfit.spec.run import RunSpec

ULYSSES_ATTENTION = {"sdpa": "sdpa", "fa2": "flash_attention_2"}


def reasons(run: RunSpec) -> list[str]:
    """What the planner's rules (memfit.plan.rules) do not see and ``memfit train`` cannot run."""
    s = run.strategy
    out = []
    if s.sequence_parallel > 1 and run.data.packing and s.attention != "fa2":
        out.append(f"sequence_parallel={s.sequence_parallel} with data.packing and attention={s.attention}: Ulysses "
                   "drops the attention mask (deepspeed ulysses_sp.py:546), so packed examples would attend to each "
                   "other under sdpa's causal mask; set data.packing=false, or attention=fa2 (on CUDA)")
    return out


def ulysses_config(run: RunSpec) -> Any:
    """accelerate's ParallelismConfig for Ulysses SP of ``strategy.sequence_parallel`` ranks. The sequence length
    is variable (the collator pads each batch to its longest row, rounded up to a multiple of N: the adapter
    requires it, ulysses_sp.py:707)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    s = run.strategy
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                              sp_attn_implementation=ULYSSES_ATTENTION.get(s.attention, "sdpa"))
    return ParallelismConfig(sp_size=s.sequence_parallel, sp_backend="deepspeed", sp_handler=handler)


def context_config(run: RunSpec, world: int) -> Any:
    """accelerate's ParallelismConfig for torch context parallelism over ``strategy.context_parallel`` ranks,
    the rest of the world sharding FSDP2 (dp_shard)."""
    from accelerate.parallelism_config import ParallelismConfig

    n = run.strategy.context_parallel
    return ParallelismConfig(cp_size=n, cp_backend="torch", dp_shard_size=max(1, world // n))


def reset_sequence_parallel() -> None:
    """Undo what an earlier Ulysses run left in this process, before the next run joins (several runs in one
    process: ``memfit measure``, the engine matrix): DeepSpeed's SP groups (parallel_state_sp.py:50 asserts they
    are unset; its ``_release_sequence_parallel_groups`` clears them), the mpu DeepSpeed's engine left in
    ``deepspeed.utils.groups`` (runtime/engine.py:2122), and the attention function Ulysses put in place of the
    model's own (ulysses_sp.py:566 sets it in transformers' ALL_ATTENTION_FUNCTIONS local mapping; deleting the
    entry restores the built-in one, transformers/utils/generic.py:1224-1234)."""
    import sys

    sp_state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if sp_state is None:
        return  # no Ulysses run in this process
    sp_state._release_sequence_parallel_groups()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and getattr(groups, "mpu", None) is sp_state:
        groups.mpu = None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, fn in list(ALL_ATTENTION_FUNCTIONS._local_mapping.items()):
        if getattr(fn, "__name__", "") == "uattn_wrapper":
            del ALL_ATTENTION_FUNCTIONS[name]
