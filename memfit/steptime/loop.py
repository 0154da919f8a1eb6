"""The host's part of a training step after its micro-batches: the optimizer phase (AdamW, clipping,
accumulation) and the HF Trainer's own loop."""

from __future__ import annotations


from memfit.engines import engine_cost
from memfit.steptime.speeds import Speeds
from memfit.steptime.constants import TimeProfile


# torch.nn.utils.clip_grad_norm_ with foreach (CUDA; torch/nn/utils/clip_grad.py): group, _foreach_norm, stack
# + vector_norm, clip coefficient, clamp, _foreach_mul_ -- a fixed handful of host ops, not two per tensor
CLIP_FOREACH_OPS = 6.0


def optimizer_seconds(sp: Speeds, engine: str, p_t: float, n: int, tensors: float, local: float, ga: int,
                      off_opt: bool, no_sync: bool = False, grad_b: float = 4.0, adam_scale: float = 1.0) -> float:
    """Seconds after the micro-batches: AdamW (unless offloaded), clipping (HF max_grad_norm: every local
    gradient read for the norm, then scaled in place) and accumulation (each later micro-batch's gradient
    added into the kept one). CPU: one thread of work, the parts add up. GPU: the Trainer's loss check after
    each micro-batch (``torch.isnan(tr_loss_step)``, transformers trainer.py) syncs the host, then the host's
    per-tensor work (AdamW's foreach bookkeeping in Python, clipping's few foreach ops) runs beside the
    device's sweeps over the parameters: the longer one counts.

    ``grad_b``: bytes per gradient value (the trainable parameters' dtype: 2 for a pure 16-bit full fine-tune,
    4 for fp32 adapters or masters); ``adam_scale``: the update's bytes against the speeds' AdamW figures, which
    are per fp32 parameter (80 B of foreach passes; a calibration times fp32 tensors): 0.5 for 16-bit states
    (memfit.estimate.setup ``optimizer_dtypes``)."""
    grads_local = p_t / (n if engine_cost(engine).shards_gradients else 1)
    clip = grads_local * grad_b * 3.0 / sp.bandwidth  # one pass of the gradients: read for the norm, scaled
    # FSDP under accelerate's no_sync accumulates its micro-batches' gradients unsharded, then reduces once
    accumulate = (ga - 1) * (p_t if no_sync else grads_local) * grad_b * 3.0 / sp.bandwidth
    adam_dev = adam_host = 0.0
    if not off_opt:
        mean_tensor = local / tensors if tensors else local
        adam_dev = local * sp.adam_seconds_per_param(mean_tensor) * adam_scale
        adam_host = tensors * sp.adam_per_tensor
    if not sp.overlap_dispatch:
        return adam_dev + adam_host + clip + 2.0 * tensors * sp.op_seconds + accumulate
    return max(adam_host + CLIP_FOREACH_OPS * sp.op_seconds, adam_dev + clip + accumulate)


def trainer_loop_ops(p: TimeProfile, ga: int, adapters: int) -> float:
    """The HF Trainer's own work per loop iteration beyond the bare loop (forward, backward, clipping, AdamW),
    in small-op costs: per step, per micro-batch, and with a PEFT model its wrappers and a share per adapted
    linear; then the loop around the step (logging, the next batch's fetch). bench/trainer_overhead.py
    measures each."""
    peft = p.trainer_peft_ops + adapters * p.trainer_adapter_step_ops if adapters else 0.0
    step = p.trainer_step_ops + ga * (p.trainer_micro_batch_ops + adapters * p.trainer_adapter_micro_batch_ops) + peft
    return step + p.trainer_outside_step_ops + ga * p.trainer_outside_micro_batch_ops
