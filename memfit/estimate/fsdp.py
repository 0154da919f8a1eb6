"""FSDP2 as accelerate wraps it (pinned accelerate 1.15, torch 2.13): what one gathered unit holds.

accelerate's ``fsdp2_prepare_model`` (accelerate/utils/fsdp_utils.py) shards every decoder layer
(``_no_split_modules``), then an untied input embedding as its own unit (:865-866), then the tail — final
norm and ``lm_head`` (+ the embedding when tied) — as one unit with ``reshard_after_forward=False``
(:871-880), then the root. Trainable parameters are upcast to fp32 masters under mixed precision
(:812-820) and gathered in ``MixedPrecisionPolicy.param_dtype``; QLoRA's packed NF4 data is gathered as
stored (4 values per bf16 element); its quantisation state is a module attribute, not gathered.
"""

from __future__ import annotations

from memfit.spec.model import ModelSpec


def fsdp_units(model: ModelSpec, trains_base: bool, frozen_bytes: float, p_t: float, compute_b: float,
               half: float) -> tuple[float, float, float]:
    """(bytes of one gathered decoder layer, bytes of the gathered tail unit, trainable parameters of
    one layer) at the dtype each unit really holds.

    ``frozen_bytes``: the frozen weights' bytes as FSDP shards them (without what it does not shard);
    ``compute_b``: bytes of a trainable parameter in the compute dtype. A full fine-tune's head and final
    norm are trainable (compute dtype); an adapter method's are frozen at their 16-bit storage (QLoRA
    under FSDP keeps them in the storage dtype: prepare_model_for_kbit_training's fp32 upcast is off).
    """
    L = model.layers
    norm = model.hidden * (2 if model.norm == "layernorm" else 1)
    tail_p = (model.head_parameters or model.embedding_parameters) + norm
    if trains_base:
        layer_t = float(model.layer_parameters)
        return layer_t * compute_b, tail_p * compute_b, layer_t
    layer_t = p_t / L
    rest = model.parameters - L * model.layer_parameters  # embeddings, final norm, head
    layer_frozen = (frozen_bytes - rest * half) / L  # what the frozen base holds per layer
    return layer_frozen + layer_t * compute_b, tail_p * half, layer_t
