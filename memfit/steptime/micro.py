"""A catalog GPU pricing a micro-batch's ops (memfit.steptime.ops), from its kind's rates:

* every linear's GEMMs at their shapes (memfit.steptime.gemm): the forward, the input gradient, the weight
  gradient when trained, the forward again under checkpointing; LoRA's rank-r products as the GEMMs they are
  (memory-bound at these shapes), in fp32 without autocast (PEFT keeps adapters in fp32; TF32 is off by
  default); weight-sized products and small kernels likewise;
* attention by length (memfit.steptime.attention);
* memory-bound work: the bytes memfit.steptime.work counts, at the bandwidth of their transfer size;
* QLoRA: each Linear4bit use dequantises its NF4 weight (0.5 byte read + 2 written per value, plus the
  absmax) as its own kernel;
* the host (memfit.steptime.host): module-level ops at ``gpu_host_op_seconds``, the engines' hooks; the
  micro-batch costs the longer of the device's time and the host's (memfit.steptime.price).
The caching allocator reuses the blocks of transient tensors: they cost nothing here.
"""

from __future__ import annotations

from memfit.steptime.attention import eager_seconds, fused_seconds
from memfit.steptime.gemm import gemm_seconds, linear_seconds
from memfit.steptime.ops import Attention, Bytes, Dequant, Dispatch, Dropout, EngineHooks, Gemm, Linear
from memfit.steptime.rates import GpuRates
from memfit.steptime.host import dispatch_ops, engine_hook_seconds

NF4_BYTES_PER_VALUE = 0.5 + 2.0 + 4.0 / 64  # packed codes read, bf16 written, fp32 absmax per 64-value block


class CatalogGpu:
    """A catalog GPU's prices for each kind of op (``profile``: the Profile's time constants)."""

    overlap = True  # kernels run while the host dispatches
    timeline = True  # collectives hide behind its device seconds (memfit.steptime.comm.exposed_comm)

    def __init__(self, g: GpuRates, profile, sp) -> None:
        self.g, self.p, self.sp = g, profile, sp  # sp: the pool's links (memfit.steptime.speeds.Speeds)
        self._linear: dict = {}

    def linear(self, op: Linear, tokens: float) -> float:
        key = (op, tokens)
        hit = self._linear.get(key)
        if hit is None:
            f, b = linear_seconds(tokens * op.share, op.k, op.n, self.g, op.weight_grad, op.e, op.fp32)
            hit = self._linear[key] = op.copies * (f * op.forwards + b)
            if len(self._linear) > 8192:
                self._linear.clear()
        return hit

    def gemm(self, op: Gemm) -> float:
        return op.count * gemm_seconds(op.m, op.n, op.k, self.g, op.e)

    def router(self, op, tokens: float) -> float:
        return 0.0  # within the kernels of MEFT's rows (its FLOPs are counted)

    def kernels(self, count: float) -> float:
        return count * self.g.gemm_kernel_seconds

    def attention(self, op: Attention, b: float, s: float) -> float:
        """By length (a sequence shared by N ranks: heads / N over N x the local length)."""
        p, g = self.p, self.g
        redo = 1.0 + (p.attention_forward_share if op.recompute else 0.0)
        heads, s = op.heads / op.context, s * op.context
        if op.eager:
            prod, scores = eager_seconds(b, heads, s, op.head_dim, g, op.e, p.eager_score_bytes)
            return op.layers * (prod + scores) * redo
        return op.layers * fused_seconds(b, heads, s, op.head_dim, g, p.mem_efficient_attention_fraction,
                                         op.package) * redo

    def exchange(self, op, tokens: float) -> float:
        """The group's collective at its link: NVLink / PCIe within a node, else the pool's bus."""
        sp = self.sp
        bus = sp.bus_intra if op.intra_node and sp.bus_intra else sp.bus(op.kind)
        n = float(op.group)
        return tokens * op.per_token * (n - 1.0) / n / bus + op.calls * sp.collective_latency

    def host_copy(self, op, tokens: float) -> float:
        """Device -> host in the forward, host -> device in the backward, over PCIe."""
        nbytes = tokens * op.per_token
        return nbytes / self.sp.d2h + nbytes / self.sp.h2d

    def bytes(self, op: Bytes, tokens: float) -> float:
        return (tokens * op.per_token + op.fixed) / self.g.bandwidth(tokens * op.size_per_token + op.size)

    def dropout(self, op: Dropout, tokens: float) -> float:
        return tokens * op.per_token * 4.0 * op.e / self.g.bandwidth(tokens * op.size_per_token)

    def dequant(self, op: Dequant) -> tuple[float, float]:
        """(device, host) seconds: one kernel per dequantised weight, at the bandwidth of its size."""
        g = self.g
        per_layer = sum(c * k * n * NF4_BYTES_PER_VALUE / g.bandwidth(k * n * NF4_BYTES_PER_VALUE)
                        for k, n, c in op.shapes)
        return op.layers * op.uses * per_layer, 0.0

    def dispatch(self, op: Dispatch) -> float:
        """Module-level ops (memfit.steptime.host) at ``gpu_host_op_seconds`` each."""
        return dispatch_ops(op, self.p) * self.p.gpu_host_op_seconds

    def engine_hooks(self, op: EngineHooks) -> tuple[float, float]:
        """(host, serial) seconds of the engine's hooks (memfit.steptime.host)."""
        return engine_hook_seconds(op, self.p)

    def sync(self, ops: float) -> float:
        return ops * self.p.gpu_host_op_seconds

    def tensors(self, op, b: float, s: float) -> float:
        return 0.0
