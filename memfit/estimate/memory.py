"""Bytes per GPU and per node's CPU RAM for one training step, by component.

Conventions: ``e`` = bytes of an activation element (2 in 16-bit, 4 in fp32); b = micro-batch,
s = sequence length, h = hidden, L = layers, N = world size. Every free constant comes from
:class:`memfit.estimate.constants.Profile`. These functions return plain floats/dicts and are called
thousands of times by the planner: keep them free of object construction.
"""

from __future__ import annotations

import math

from memfit.estimate.constants import Profile
from memfit.spec.model import ModelSpec

# Optimizer state bytes per trainable parameter, without any fp32 master copy.
_OPT_STATES = {"adamw": 8.0, "adamw8bit": 2.0, "sgd": 4.0}


def state_bytes(precision: str, optimizer: str, family: str = "deepspeed") -> tuple[float, float, float, float]:
    """(weight, gradient, optimizer, compute copy) bytes per *trainable* parameter for an engine family.

    - ``deepspeed`` (ZeRO 1–3; the ZeRO paper's convention): 16-bit params and grads, the optimizer
      holds the fp32 master + states: mixed Adam 2 + 2 + 12. DeepSpeed's bf16 mode keeps an fp32
      master too, so pure ``bf16`` counts like mixed. fp32: 4 + 4 + (4 master + states): DeepSpeed keeps
      its flat fp32 partition apart from the module's parameters (measured on CPU with gloo).
    - ``ddp`` (torch autocast, as the HF Trainer runs it): fp32 params and grads + states; autocast's
      16-bit copy of every trainable weight is saved for backward (``compute copy`` = 2 B, counted
      under weights). Pure bf16: 2 + 2 + states in bf16 (Adam 4).
    - ``fsdp`` (MixedPrecision policy): fp32 flat params, fp32 grads, states, all sharded; the 16-bit
      compute copy exists only while gathered (gathered_params / shard_grad_op's unsharded copy).
    """
    states = _OPT_STATES[optimizer]
    if family == "deepspeed":  # a separate flat fp32 master partition, even when training in fp32
        return (4.0, 4.0, 4.0 + states, 0.0) if precision == "fp32" else (2.0, 2.0, 4.0 + states, 0.0)
    if precision == "fp32":
        return 4.0, 4.0, states, 0.0
    if precision == "bf16":
        return 2.0, 2.0, states / 2.0 if optimizer != "adamw8bit" else states, 0.0
    return 4.0, 4.0, states, 2.0


class ModelNumbers:
    """Per-model constants precomputed once (the planner calls estimate() thousands of times)."""

    __slots__ = ("model", "tok_mlp", "q_kv_sdpa", "q_kv_eager", "attn_out", "n_norms", "heads",
                 "linear_params", "other_params", "layer_params", "largest_linear", "dropout_mask", "_lora")

    def __init__(self, m: ModelSpec) -> None:
        self.model = m
        # values saved per token per layer (multiply by e), apart from norms:
        self.q_kv_sdpa = m.q_dim + 2 * m.kv_dim  # q, k after RoPE and v, as the attention kernel saves them
        self.q_kv_eager = 3 * m.q_dim  # eager attention expands GQA k/v to all heads (repeat_kv) before matmul
        self.attn_out = 2 * m.q_dim  # kernel output + the contiguous copy o_proj saves
        # gated MLPs (SwiGLU, GeGLU) keep gate, act(gate), up and their product; a plain GeLU MLP two values
        self.tok_mlp = (4 if m.mlp in ("swiglu", "geglu") else 2) * m.intermediate
        self.n_norms = m.norms_per_layer
        self.dropout_mask = 2 * m.hidden if m.hidden_dropout > 0 else 0
        self.heads = m.heads
        self.linear_params = m.linear_layer_parameters
        self.other_params = m.parameters - self.linear_params
        self.layer_params = m.layer_parameters
        self.largest_linear = max(lin.in_features * lin.out_features for lin in m.linears)
        self._lora: dict = {}

    def lora_sums(self, targets) -> tuple[int, int]:
        """(adapted linears per layer, sum of their in_features) for ``targets`` (cached)."""
        hit = self._lora.get(targets)
        if hit is None:
            lins = self.model.lora_linears(targets)
            hit = (len(lins), sum(lin.in_features for lin in lins))
            self._lora[targets] = hit
        return hit


_CACHE: dict[int, ModelNumbers] = {}


def numbers(model: ModelSpec) -> ModelNumbers:
    hit = _CACHE.get(id(model))
    if hit is None or hit.model is not model:
        hit = ModelNumbers(model)
        _CACHE[id(model)] = hit
    return hit


def norm_bytes_per_token(model: ModelSpec, e: float) -> float:
    """Bytes one norm saves per token: RMSNorm (fp32 copy 4 + output e), LayerNorm (input e + output e)."""
    return model.hidden * ((4.0 + e) if model.norm == "rmsnorm" else 2.0 * e)


def layer_activation_bytes(model: ModelSpec, s: int, b: int, e: float, attention: str) -> float:
    """Bytes one decoder layer saves for backward, derived from the HF block structure.

    Per token: norms + q/k/v as the attention kernel keeps them + attention output (twice) + MLP
    (SwiGLU 4·f, GeLU 2·f values). Eager adds the score matrices: fp32 softmax (4 B) and its cast (e)
    per head and query-key pair (Falcon: e only; + a 1-byte dropout mask and its output if attention
    dropout > 0). Checked against the tensors autograd saves for tiny HF Llama/Falcon/GPT-NeoX models
    (saved_tensors_hooks, per-layer difference of 1 vs 3 layers): predicted within −5 % … +9 %.
    Flash / memory-efficient SDPA keep only a fp32 log-sum-exp per head and token.
    """
    n = numbers(model)
    norms = n.n_norms * norm_bytes_per_token(model, e)
    if model.qk_norm:  # per-head RMSNorm on q and k: fp32 copy + output of each
        norms += (4.0 + e) * (model.q_dim + model.kv_dim)
    if attention == "eager":
        per_tok = norms + e * (n.q_kv_eager + n.attn_out + n.tok_mlp) + (1 + e) * n.dropout_mask
        if model.family == "falcon":  # Falcon's eager softmax runs in the compute dtype
            score = e
        else:  # the generic HF eager path: softmax in fp32, cast back to the compute dtype
            score = 4.0 + (e if e != 4.0 else 0.0)
        score += (1.0 + e) if model.attention_dropout > 0 else 0.0
        return b * s * per_tok + b * n.heads * float(s) * s * score
    per_tok = norms + e * (n.q_kv_sdpa + n.attn_out + n.tok_mlp) + (1 + e) * n.dropout_mask + 4.0 * n.heads
    return b * s * per_tok


def korthikanti_layer_bytes(model: ModelSpec, s: int, b: int, attention: str) -> float:
    """GPT-style count (Korthikanti et al. 2022, eq. 1): s·b·h·(34 + 5·a·s/h); fused kernels drop the s² term."""
    h = model.hidden
    base = 34.0 * s * b * h
    return base + (5.0 * model.heads * s * s * b if attention == "eager" else 0.0)


def activation_parts(model: ModelSpec, s: int, b: int, e: float, attention: str, checkpointing: bool,
                     profile: Profile) -> tuple[float, float, float]:
    """(checkpointed layer inputs, layers' saved working sets, tail) in bytes.

    Without checkpointing every layer's working set is saved. With it, each layer keeps its input
    (e·s·b·h) and ``checkpoint_extra_layers`` layers' working set is live during recomputation. The tail
    is the final norm and the head's input."""
    scale = profile.activation_scale
    if profile.activation_korthikanti:
        layer = korthikanti_layer_bytes(model, s, b, attention)
        tail = 0.0
    else:
        layer = layer_activation_bytes(model, s, b, e, attention)
        tail = b * s * (norm_bytes_per_token(model, e) + e * model.hidden)
    if checkpointing:
        return (model.layers * e * b * s * model.hidden * scale, profile.checkpoint_extra_layers * layer * scale,
                tail * scale)
    return 0.0, model.layers * layer * scale, tail * scale


def activation_bytes(model: ModelSpec, s: int, b: int, e: float, attention: str, checkpointing: bool,
                     profile: Profile) -> float:
    """All saved activations: the sum of :func:`activation_parts`."""
    inputs, layers, tail = activation_parts(model, s, b, e, attention, checkpointing, profile)
    return inputs + layers + tail


def logits_bytes(model: ModelSpec, s: int, b: int, precision: str, profile: Profile) -> float:
    """b·s·V values at the loss peak: the logits, the fp32 log-softmax and two fp32 gradients."""
    per = profile.logits_bytes_fp32 if precision == "fp32" else profile.logits_bytes_16bit
    return float(b) * s * model.vocab * per


def lora_intermediate_bytes(model: ModelSpec, s: int, b: int, e: float, targets, r: int, dropout: float,
                            checkpointing: bool, profile: Profile, cast_copy: float = 0.0) -> float:
    """Per adapted linear: the rank-r intermediate (e·s·b·r) and the input lora_A saves: with
    lora_dropout > 0 the dropped copy and its mask ((e + 1)·s·b·in); without dropout a cast copy
    (``cast_copy`` bytes per input value: PEFT's fp32 cast in pure bf16), else nothing (under autocast the
    16-bit input is shared with the base linear). With checkpointing only the recomputed layer(s)."""
    count, sum_in = numbers(model).lora_sums(targets)
    copy = (e + 1.0) if dropout > 0 else cast_copy
    per_layer = (count * e * r + copy * sum_in) * b * s
    layers = profile.checkpoint_extra_layers if checkpointing else model.layers
    return per_layer * layers


def meft_rows(model: ModelSpec, neurons: int, top_k: int, b: int, s: int, profile: Profile) -> float:
    """Distinct adapter rows (β·K) a micro-batch activates per layer: the top-K union over b·s tokens,
    capped by the device buffer (``meft_buffer_fraction`` of the neurons)."""
    return float(min(neurons * profile.meft_buffer_fraction, top_k * b * s, neurons))


def meft_experts(neurons: int, experts) -> int:
    return int(math.ceil(math.sqrt(neurons))) if experts == "auto" else int(experts)
