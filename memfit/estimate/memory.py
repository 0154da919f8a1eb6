"""Bytes per GPU and per node's CPU RAM for one training step, by component.

Conventions: ``e`` = bytes of an activation element (2 in 16-bit, 4 in fp32); b = micro-batch,
s = sequence length, h = hidden, L = layers, N = world size. Every free constant comes from
:class:`memfit.estimate.constants.Profile`. These functions return plain floats/dicts and are called
thousands of times by the planner: keep them free of object construction.
"""

from __future__ import annotations

from memfit.estimate.activations import ROLES
from memfit.estimate.constants import Profile
from memfit.spec.model import ModelSpec
from memfit.spec.strategy import liger_chunk_tokens, loss_chunk_tokens

# Optimizer state bytes per trainable parameter, without any fp32 master copy.
_OPT_STATES = {"adamw": 8.0, "adamw8bit": 2.0, "sgd": 4.0}


def state_bytes(precision: str, optimizer: str, master_partition: bool = True,
                fp32_params_are_master: bool = False) -> tuple[float, float, float, float]:
    """(weight, gradient, optimizer, compute copy) bytes per *trainable* parameter for an engine family
    (``master_partition``: DeepSpeed's flat fp32 master; ``fp32_params_are_master``: ZeRO-3's, as memfit.engines
    records them).

    - ``deepspeed`` (ZeRO 1–3; the ZeRO paper's convention): 16-bit params and grads, the optimizer
      holds the fp32 master + states: mixed Adam 2 + 2 + 12. DeepSpeed's bf16 mode keeps an fp32
      master too, so pure ``bf16`` counts like mixed. fp32 under ZeRO-1/2: 4 + 4 + (4 master + states):
      DeepSpeed keeps its flat fp32 partition apart from the module's parameters (measured on CPU with
      gloo); fp32 under ZeRO-3: 4 + 4 + states, the partitioned parameters are the master (no copy:
      bench/distributed_memory.py measured 18.9 MB where a copy would make 25.2 MB).
    - ``ddp`` (torch autocast, as the HF Trainer runs it): fp32 params and grads + states; autocast's
      16-bit copy of every trainable weight is saved for backward (``compute copy`` = 2 B, counted
      under weights). Pure bf16: 2 + 2 + states in bf16 (Adam 4).
    - ``fsdp`` (MixedPrecision policy): fp32 flat params, fp32 grads, states, all sharded; the 16-bit
      compute copy exists only while gathered (gathered_params / shard_grad_op's unsharded copy).
    """
    states = _OPT_STATES[optimizer]
    if master_partition:  # a separate flat fp32 master partition (in fp32 too, except ZeRO-3)
        if precision == "fp32":
            return 4.0, 4.0, states + (0.0 if fp32_params_are_master else 4.0), 0.0
        return 2.0, 2.0, 4.0 + states, 0.0
    if precision == "fp32":
        return 4.0, 4.0, states, 0.0
    if precision == "bf16":
        return 2.0, 2.0, states / 2.0 if optimizer != "adamw8bit" else states, 0.0
    return 4.0, 4.0, states, 2.0


class ModelNumbers:
    """Per-model constants precomputed once (the planner calls estimate() thousands of times)."""

    __slots__ = ("model", "linear_params", "other_params", "layer_params", "largest_linear", "_lora", "_adapted")

    def __init__(self, m: ModelSpec) -> None:
        self.model = m
        self.linear_params = m.linear_layer_parameters
        self.other_params = m.parameters - self.linear_params
        self.layer_params = m.layer_parameters
        self.largest_linear = max(lin.in_features * lin.out_features for lin in m.linears)
        self._lora: dict = {}
        self._adapted: dict = {}

    def lora_sums(self, targets) -> tuple[int, int, frozenset]:
        """(adapted linears per layer, sum of their in_features, their names) for ``targets`` (cached)."""
        hit = self._lora.get(targets)
        if hit is None:
            lins = self.model.lora_linears(targets)  # per token: an expert's adapter sees top-k / E of them
            hit = (sum(lin.count * lin.active for lin in lins),
                   sum(lin.count * lin.active * lin.in_features for lin in lins), frozenset(lin.name for lin in lins))
            self._lora[targets] = hit
        return hit


    def adapted_linears(self, adapted: frozenset) -> tuple[int, tuple, int]:
        """For the adapted linears named ``adapted`` (cached): (the widest in_features, (in_features, count,
        active) of those that do not read the layer's input, the in_features summed over those that do)."""
        hit = self._adapted.get(adapted)
        if hit is None:
            lins = [lin for lin in self.model.linears if lin.name in adapted]
            hit = (max((lin.in_features for lin in lins), default=0),
                   tuple((lin.in_features, lin.count, lin.active) for lin in lins if ROLES.get(lin.name) != "attn_in"),
                   sum(lin.in_features for lin in lins if ROLES.get(lin.name) == "attn_in"))
            self._adapted[adapted] = hit
        return hit


_CACHE: dict[int, ModelNumbers] = {}


def numbers(model: ModelSpec) -> ModelNumbers:
    hit = _CACHE.get(id(model))
    if hit is None or hit.model is not model:
        hit = ModelNumbers(model)
        _CACHE[id(model)] = hit
    return hit


def logits_bytes(model: ModelSpec, s: int, b: int, precision: str, profile: Profile,
                 loss: str = "standard", fused: bool = True, liger: bool = False) -> float:
    """b·s·V values at the loss peak: the logits, the fp32 log-softmax and two fp32 gradients. With
    ``loss="chunked"`` (memfit.train.loss) one chunk of ``loss_chunk_tokens`` tokens: the forward makes
    each chunk's logits, loss and gradients and frees them before the next chunk (or, on the recomputing
    path, backward recomputes them chunk by chunk), so the same per-logit bytes are live for one chunk at
    a time: on the fused path (``fused``) ``chunked_logits_bytes`` per logit (the chunk's fp32 logits, turned
    into the softmax and the gradient in place, and logsumexp's temporary), on the recomputing path the
    standard path's (the recomputed logits, their log-softmax and the two gradients). ``liger``: Liger's fused
    linear cross-entropy, one chunk of :func:`liger_chunk_tokens` logits in the input's dtype (``logits_storage``,
    the cross-entropy kernel writes the gradient over it)."""
    if liger:
        return float(liger_chunk_tokens(model.vocab, model.hidden, b * s)) * model.vocab * \
            (4.0 if precision == "fp32" else 2.0)
    per = profile.logits_bytes_fp32 if precision == "fp32" else profile.logits_bytes_16bit
    tokens = float(b) * s
    if loss == "chunked":
        tokens = float(loss_chunk_tokens(model.vocab, b * s))
        if fused:
            per = profile.chunked_logits_bytes
    return tokens * model.vocab * per


def with_buckets(profile: Profile, model: ModelSpec, distributed) -> Profile:
    """The Profile with a run's DeepSpeed bucket settings (memfit.distributed.config writes them into the
    DeepSpeed JSON: reduce_bucket_size, allgather_bucket_size, stage3_prefetch_bucket_size = 0.9 x reduce)."""
    h2 = float(model.hidden) ** 2
    values = {}
    rb = getattr(distributed, "reduce_bucket_size", None)
    if rb:
        values.update(zero_reduce_bucket_per_h2=rb / h2, zero3_prefetch_per_h2=0.9 * rb / h2)
    ag = getattr(distributed, "allgather_bucket_size", None)
    if ag:
        values["zero_allgather_bucket_elements"] = float(ag)
    return profile.with_values(**values) if values else profile
