"""The sharded engines' own work on the host, beside their collectives (CPU processes).

Counted on 2-rank gloo runs of a 39-tensor h-256 Llama (full fine-tuning, fp32; docs/time.md "Sharded
engines on a CPU" has the commands): per optimizer step, with one micro-batch,

* **DeepSpeed ZeRO-1/2** (0.19.8, runtime/zero/stage_1_and_2.py): every gradient goes through
  ``reduce_independent_p_g_buckets_and_remove_grads`` -> ``reduce_ipg_grads`` -> ``average_tensor`` ->
  ``allreduce_and_copy_with_multiple_ranks``: a copy into the contiguous IPG bucket (gradients no larger
  than the bucket), the post-scale ``mul_``/``div_`` by the world size, the all-reduce, ``buf.copy_(synced)``
  back and the kept partition's copy: (6 + 2/n) passes of its bytes and 14.3 aten ops per gradient (558 over
  39, counted with a TorchDispatchMode), whose Python costs more than 14 small ops: 17-30 ms of main-thread
  CPU per step in the hooks, ~7.4 ms of it the copies -> ~30 small-op costs per gradient (op_seconds
  measured beside it: 10.4 us; the all-reduces' launches included, which the collectives' calibrated
  latency partly holds too). The step (``get_grad_norm_direct`` per gradient, the flat fp32 partition's
  bookkeeping, timers, memory reports; 9.6 aten ops per gradient): 21-26 ms of CPU less its flat AdamW
  (the optimizer part) and ~2.6 ms of copies -> ~35 small-op costs per gradient.
* **FSDP2** (torch 2.13 fsdp/_fully_shard, as accelerate 1.x wraps a causal LM: each decoder layer, the
  input embedding, and [final norm, lm_head] as groups, fsdp_utils.py ``fsdp2_prepare_model``): per
  micro-batch each all-gather copies the shard in (``all_gather_copy_in``, 2 passes of the shard) and the
  gathered parameters out (``split_with_sizes_copy``, 2 passes of the whole), each reduce-scatter packs
  the gradients (``chunk_cat``, 2 passes) and keeps its shard (2 passes of the shard); the hooks' Python
  (unshard / reshard bookkeeping, one DTensor per sharded gradient, record_function scopes) cost 39-48 ms
  of main-thread CPU per step over 39 parameters, ~9.5 ms of it those copies: ~83 small-op costs per
  parameter (op_seconds measured beside it: 10.6 us). The optimizer then steps DTensors: each of AdamW's
  ~9.4 ops per tensor (367 over 39, counted) pays DTensor's dispatch on top (AdamW.step: 17-26 ms over 39
  shards of 1.7 M elements vs 10.2 ms over 39 whole tensors of 3.4 M: ~4 small-op costs per op).

On a GPU this host work runs while the device computes (and is unmeasured there), and with offload the
engines take other paths (unmeasured): not added.
"""

from __future__ import annotations


from memfit.engines import engine_cost
from memfit.steptime.constants import TimeProfile


def engine_host_seconds(engine: str, fsdp: bool, tensors: float, tensors_all: float, p_t: float, g_b: float,
                        gather_bytes: float, n: int, ga: int, op_seconds: float, bandwidth: float,
                        p: TimeProfile) -> float:
    """Seconds per optimizer step of the engine's host work outside its collectives and the optimizer's
    own sweep: ``tensors`` trainable tensors (all of them, not a shard), ``tensors_all`` every parameter
    tensor (FSDP's hooks visit the frozen ones too), ``p_t`` trainable parameters of
    ``g_b`` gradient bytes, ``gather_bytes`` the whole gathered weights (FSDP), ``n`` processes, ``ga``
    micro-batches, on a CPU with one small op costing ``op_seconds`` and ``bandwidth`` bytes/s."""
    if n <= 1:
        return 0.0
    grads, eng = p_t * g_b, engine_cost(engine, fsdp)
    if eng.tensor_hooks and not fsdp:
        reductions = ga if eng.reduces_every_micro_batch else 1
        per = tensors * p.deepspeed_grad_ops * op_seconds + (6.0 + 2.0 / n) * grads / bandwidth
        return reductions * per + tensors * p.deepspeed_step_ops * op_seconds
    if fsdp and eng.unit_hooks:
        gathers = float(eng.weight_gathers)  # as memfit.steptime.comm.comm_parts (none more under gc)
        copies = gathers * gather_bytes * (2.0 + 2.0 / n) + grads * (2.0 + 2.0 / n)
        per = tensors_all * p.fsdp2_ops_per_param * op_seconds + copies / bandwidth
        return ga * per + tensors * p.adamw_ops_per_tensor * p.dtensor_op_extra * op_seconds
    return 0.0
