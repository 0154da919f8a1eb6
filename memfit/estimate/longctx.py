"""Long context (docs/long-context.md): what sequence / context parallelism, activation offloading and the tiled
MLP change in one rank's memory. Paths under ``site-packages/`` at the pinned versions.

- **Sequence shards.** Ulysses (deepspeed 0.19.8 ``runtime/sequence_parallel/ulysses_sp.py``
  ``UlyssesSPAttentionHF``; ``UlyssesSPDataLoaderAdapter`` hands each of the N ranks seq_len / N tokens of one
  sample) and torch's context parallelism (``torch/distributed/tensor/experimental/_attention.py``
  ``context_parallel``: every buffer split along the sequence) leave each rank the layers, the loss and the
  adapters over seq_len / N tokens: the estimate prices those at the local length (:func:`local`). Inside
  attention Ulysses swaps the sequence shard for a head shard (all heads / N over the whole sequence: the same
  bytes for a fused kernel, whose saved q, k, v, output and log-sum-exp are linear in both); its four
  all-to-alls per layer (q, k, v, then the output; the gradients likewise) hold their input and output
  buffers in flight. Context parallelism all-gathers the whole sequence's keys and values before attention
  (the default ``_RotateMethod.ALL_GATHER``) and reduce-scatters their gradients after its backward.
- **Activation offloading.** ``checkpointed``: transformers' ``activation_checkpointing_enable(offload=True)``
  (transformers 5.24 ``modeling_utils.py`` ``_activation_checkpointing_enable``) wraps each checkpoint in
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)``; torch's non-reentrant checkpoint saves the layer's
  positional inputs through the hooks active when it starts (``torch/utils/checkpoint.py``
  ``_CheckpointFrame.save_inputs`` → ``_make_saved_tensor``), so each layer's input (the hidden states)
  is copied into a pinned host tensor and the device copy freed; the recomputation brings one back at a time.
  ``all``: ``save_on_cpu`` around forward and backward: every tensor autograd saves outside a checkpoint
  (with checkpointing that is again the layers' inputs; the recomputed layer's tensors are saved inside the
  checkpoint's own hooks, on the device). ``save_on_cpu``'s pack hook allocates with ``pin_memory=True``, through
  the pinned allocator that rounds each block up to a power of two (memfit.estimate.pinned).
- **Tiled MLP** (``ulysses_sp.py`` ``TiledMLP``, ``tiled_mlp_forward``: ``ceil(seqlen / hidden)`` shards): the
  MLP's forward runs shard by shard without saving anything but its input; its backward recomputes each shard
  with gradients, so only one shard's intermediates and their gradients are live (priced with the layer's saved
  set: memfit.estimate.activations ``mlp_shards``).
"""

from __future__ import annotations

from typing import NamedTuple

from memfit.estimate.pinned import pinned_block
from memfit.estimate.saved import Saved
from memfit.estimate.setup import Setup
from memfit.spec.strategy import Strategy


def degree(st: Strategy) -> int:
    """Ranks that share one sequence (Ulysses or context parallelism; 1: none)."""
    return st.sequence_parallel * st.context_parallel


def local(st: Strategy) -> Strategy:
    """The strategy one rank runs: seq_len / N tokens of each sample (sequence or context parallelism)."""
    n = degree(st)
    return st if n == 1 else st.model_copy(update={"seq_len": st.seq_len // n})


class LongContext(NamedTuple):
    saved: Saved               # what the forward saves on the device, after offloading and tiling
    host: float                # pinned host bytes per process holding offloaded activations
    moved: float               # bytes copied device -> host per micro-batch (and back in backward)
    exchange: float            # bytes one layer's sequence exchange holds in flight (all-to-all / K, V gathered)


def _outside(run: Setup, saved: Saved) -> tuple[float, list]:
    """What autograd saves outside the checkpointed layers, which ``all`` packs too: the final norm's and the
    head's inputs (the tail), the head's weight (a linear saves its W^T for the input's gradient; save_on_cpu
    copies it), the standard loss's fp32 logits twice (the cross-entropy's input and its log-softmax; the chunked
    loss keeps no full logits); without checkpointing the layers' weights likewise (memfit train counts them:
    metrics.jsonl act_offload_weight_bytes). (bytes, the tensors' sizes for the pinned blocks)."""
    st, model = run.strategy, run.model
    tokens = float(st.micro_batch_size) * st.seq_len
    head = float(model.vocab * model.hidden) * run.value_b
    logits = 4.0 * tokens * model.vocab if st.loss == "standard" else 0.0
    sizes = [saved.act_tail / 2.0, saved.act_tail / 2.0, head] + ([logits, logits] if logits else [])
    if not run.gc:  # every layer's linears save their W^T for the input's gradient (frozen ones too): packed
        # each step (with checkpointing they are saved inside the checkpoints, on the device)
        sizes += [float(x.in_features * x.out_features) * run.value_b
                  for x in model.linears for _ in range(x.count)] * model.layers
    return sum(sizes), sizes


def _offloaded(run: Setup, saved: Saved) -> tuple[float, float]:
    """(bytes offloaded per micro-batch, pinned host bytes per process)."""
    st, model = run.strategy, run.model
    mode = st.activation_offload
    if mode == "none":
        return 0.0, 0.0
    if run.gc:  # both modes: each checkpointed layer's input
        per_layer = saved.act_in / model.layers
        moved, host = saved.act_in, model.layers * pinned_block(per_layer)
    elif mode == "checkpointed":
        return 0.0, 0.0  # a rule refuses it without checkpointing (memfit.plan.rules)
    else:  # all, without checkpointing: every saved tensor of the layers and the method's own, rounded as blocks
        # of the residual stream's size (the layers' largest saved tensors are multiples of it)
        moved = saved.act_layers + saved.adapter.intermediates
        unit = float(st.micro_batch_size) * st.seq_len * model.hidden * run.value_b
        host = moved * (pinned_block(unit) / unit if unit else 1.0)
    if mode == "all":
        extra, sizes = _outside(run, saved)
        moved, host = moved + extra, host + sum(pinned_block(x) for x in sizes)
    return moved, host


def _exchange(run: Setup, global_seq: int) -> float:
    """Bytes one layer's sequence exchange holds in flight beside its working set."""
    st, model, e = run.strategy, run.model, run.value_b
    b = float(st.micro_batch_size)
    if st.sequence_parallel > 1:  # the all-to-alls' input and output buffers: q, k, v and the output; a KV head
        # replicated where N exceeds the KV heads (ulysses_sp.py kv_replication_factor)
        kv = max(model.kv_dim, model.head_dim * st.sequence_parallel) if st.sequence_parallel > model.kv_heads \
            else model.kv_dim
        return 2.0 * b * st.seq_len * (2 * model.q_dim + 2 * kv) * e
    if st.context_parallel > 1:  # the whole sequence's keys and values, and in backward their gradients
        return 2.0 * 2.0 * b * global_seq * model.kv_dim * e
    return 0.0


def long_context(run: Setup, saved: Saved, global_seq: int) -> LongContext:
    """``saved`` (at the local length; the tiled MLP's in memfit.estimate.activations) after offloading, the host
    bytes and copies, the exchange."""
    moved, host = _offloaded(run, saved)
    if run.gpu.is_cpu:  # no device to leave: the copies land in the same RAM the originals leave
        host = 0.0
    elif moved:
        if run.gc:  # the recomputation brings one layer's input back at a time
            saved = saved._replace(act_in=saved.act_in / run.model.layers)
        else:  # the backward brings one layer's saved tensors back at a time
            saved = saved._replace(act_layers=saved.act_layers / run.model.layers)
        if run.strategy.activation_offload == "all":  # the tail waits on the host until the head's backward
            saved = saved._replace(act_tail=0.0)
    exchange = _exchange(run, global_seq)
    if exchange:
        saved = saved._replace(act_bwd=saved.act_bwd + exchange)
    return LongContext(saved, host, moved, exchange)
