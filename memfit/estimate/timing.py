"""Time of one optimizer step (= grad_accum micro-batches on every GPU), by part.

FLOPs: 6·P per token for full fine-tuning (forward 2, backward 4), 4·P with frozen weights (no weight
gradients) + 6·P_adapter, + 2·P with recomputation; attention 4·s²·(heads·head_dim) per layer and
sequence forward, ×3 with backward (+1 forward with recomputation). Divided by peak × utilisation.
Communication per GPU follows the ring collectives of each engine; only the part not hidden by
overlap counts. Offload adds PCIe traffic and the CPU optimizer; MEFT adds its PCIe traffic and CPU
search. Every constant is in :class:`~memfit.estimate.constants.Profile`.
"""

from __future__ import annotations

from memfit.estimate.constants import Profile
from memfit.spec.hardware import HardwareSpec
from memfit.spec.model import ModelSpec


def effective_flops(hw: HardwareSpec, precision: str, tokens_per_micro: float, profile: Profile) -> float:
    """Achieved FLOP/s of one device for this precision and micro-batch size."""
    gpu = hw.gpu
    if gpu.is_cpu:  # a CPU is saturated by small matmuls already; N processes share its cores
        return gpu.fp32_flops * profile.utilization_cpu / hw.gpus_per_node
    if precision == "fp32":
        base = gpu.fp32_flops * profile.utilization_fp32
    else:
        base = gpu.peak_flops * profile.utilization
    half = profile.utilization_half_tokens
    return base * tokens_per_micro / (tokens_per_micro + half) if half > 0 else base


def step_flops(model: ModelSpec, s: int, b: int, ga: int, full: bool, adapter_params: float,
               checkpointing: bool, adapter_flops_per_token: float = 0.0) -> tuple[float, float, float]:
    """(dense FLOPs, attention FLOPs, adapter FLOPs) per GPU per optimizer step."""
    tokens = float(b) * s * ga
    p = model.matmul_parameters
    per_tok = (6.0 if full else 4.0) * p + (2.0 * p if checkpointing else 0.0)
    attn_fwd = 4.0 * s * s * model.q_dim * model.layers  # per sequence
    attn = b * ga * attn_fwd * (4.0 if checkpointing else 3.0)
    adapter = tokens * (6.0 * adapter_params + adapter_flops_per_token)
    return tokens * per_tok, attn, adapter


def chunked_loss_flops(model: ModelSpec, tokens: float) -> float:
    """The chunked loss's recomputation (memfit.train.loss): each chunk's logits are computed again in
    backward, one more forward of the output projection, 2·V·h FLOPs per token (tied head included)."""
    return 2.0 * tokens * model.vocab * model.hidden


def collective_seconds(bytes_per_gpu: float, hw: HardwareSpec, profile: Profile) -> float:
    """Ring collective time for ``bytes_per_gpu`` of payload ((N−1)/N of it crosses each link)."""
    n = hw.world_size
    if n <= 1 or bytes_per_gpu <= 0:
        return 0.0
    if hw.nodes > 1:
        bw = min(hw.inter_node_bandwidth * profile.inter_node_efficiency,
                 hw.gpu.intra_node_bandwidth * profile.intra_node_efficiency)
    else:
        bw = hw.gpu.intra_node_bandwidth * profile.intra_node_efficiency
    return bytes_per_gpu * (n - 1) / n / bw


def comm_bytes(engine_kind: str, p_all: float, weight_bytes_all: float, p_t: float, g_b: float, w_b: float,
               ga: int, checkpointing: bool) -> float:
    """Bytes each GPU sends per optimizer step for its engine.

    ddp: all-reduce of trainable grads at the step (2·P_t·g_b). zero1: reduce-scatter grads + all-gather
    updated params at the step. zero2/shard_grad_op: reduce-scatter every micro-batch + all-gather at the
    step (shard_grad_op also gathers all params once per micro-batch). zero3/full_shard: every micro-batch
    gathers all weights in forward and again in backward (and in recomputation) + reduce-scatters grads.
    """
    if engine_kind == "ddp":
        return 2.0 * p_t * g_b
    if engine_kind == "zero1":
        return p_t * g_b + p_t * w_b
    if engine_kind == "zero2":
        return ga * p_t * g_b + p_t * w_b
    if engine_kind == "sgo":
        return ga * (weight_bytes_all + p_t * g_b)
    gathers = 3.0 if checkpointing else 2.0
    return ga * (gathers * weight_bytes_all + p_t * g_b)


def overlap_for(engine_kind: str, profile: Profile) -> float:
    if engine_kind == "ddp":
        return profile.overlap_ddp
    if engine_kind in ("zero1", "zero2", "sgo"):
        return profile.overlap_zero12
    return profile.overlap_zero3


def pcie_seconds(nbytes: float, hw: HardwareSpec, profile: Profile) -> float:
    return nbytes / (hw.gpu.pcie_bandwidth * profile.pcie_efficiency) if nbytes > 0 else 0.0
