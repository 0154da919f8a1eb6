"""Measured speeds pricing a micro-batch's ops (memfit.steptime.ops): ``memfit calibrate --hardware`` (this
CPU, or a calibrated GPU) or an uncalibrated CPU's guess: linears at the GEMM rate of their width, attention at
the measured curve, bytes at the measured bandwidth, the measured dispatch; on a CPU its own mechanisms besides
(first-touch page faults, the flash kernel's blocks, dropout's draws: memfit.steptime.cpu). Catalog GPUs:
memfit.steptime.micro.
"""

from __future__ import annotations

from memfit.steptime.cpu import fresh_bytes, mmap_threshold
from memfit.steptime.ops import (Attention, Bytes, Dequant, Dispatch, Dropout, EngineHooks, Exchange, Gemm, HostCopy,
                                 Linear, Router, Tensors)
from memfit.steptime.speeds import Speeds
from memfit.steptime.work import RECOMPUTE_DISPATCH


def dispatch_seconds(op: Dispatch, sp: Speeds) -> float:
    """Host-side cost of one micro-batch's forward + backward: measured per transformers layer / PEFT
    adapter where calibrated, else op counts x the per-op cost."""
    L, redo, adapted = op.layers, 1.0 + (RECOMPUTE_DISPATCH if op.recompute else 0.0), op.adapters
    if sp.overheads is not None:
        layer, rest, adapter, eager_extra, gc_extra = sp.overheads
        per_layer = layer + adapted * adapter + (eager_extra if op.eager else 0.0)
        if op.recompute and gc_extra is not None:  # measured: torch.utils.checkpoint's cost + the recomputed layer
            return L * (per_layer + gc_extra + RECOMPUTE_DISPATCH * adapted * adapter) + rest
        return L * redo * per_layer + rest
    return ((op.layer_ops + op.adapter_ops) * L * redo + op.model_ops) * sp.op_seconds


class MeasuredDevice:
    """Prices for each kind of op at measured speeds ``sp`` (memfit.steptime.speeds)."""

    timeline = False  # no device timeline apart: collectives hide by the Profile's share (comm.exposed_comm)

    def __init__(self, sp: Speeds) -> None:
        self.sp = sp
        self.overlap = sp.overlap_dispatch  # a GPU's kernels run while the host dispatches; a CPU does both in turn
        self._rate: dict = {}

    def _gemm_rate(self, k: float, n: float) -> float:
        key = (k, n)
        hit = self._rate.get(key)
        if hit is None:
            hit = self._rate[key] = self.sp.gemm(k, n)
        return hit

    def linear(self, op: Linear, tokens: float) -> float:
        """At the GEMM rate of its width (LoRA's rank-r products at the skinny rate)."""
        rate = self.sp.gemm_skinny if op.skinny else self._gemm_rate(op.k, op.n)
        return op.flops(tokens) / rate

    def gemm(self, op: Gemm) -> float:
        return op.flops(0.0) / self._gemm_rate(op.k, op.n)

    def router(self, op: Router, tokens: float) -> float:
        return op.flops(tokens) / self.sp.gemm_skinny

    def kernels(self, count: float) -> float:
        return 0.0  # their launches are among the measured dispatch

    def attention(self, op: Attention, b: float, s: float) -> float:
        """Forward + backward at the measured rate, + the forward again under checkpointing at its measured
        share; eager attention's products and the work on its b·H·s² scores apart where calibrated."""
        sp, gc = self.sp, op.recompute
        s = s * op.context  # a sequence shared by N ranks: each attends heads / N over the whole length
        attn_fb = 12.0 * b * s * s * op.q_dim / op.context * op.layers
        if op.eager and sp.eager_bmm:
            scores = float(b) * op.heads / op.context * s * s
            return attn_fb / sp.eager_bmm_rate(op.head_dim) * (1.0 + (1.0 / 3.0 if gc else 0.0)) + op.layers * \
                scores * sp.score_seconds(scores * op.e) * (1.0 + (sp.eager_scores_forward_share if gc else 0.0))
        return attn_fb / sp.attention_rate(s, op.head_dim) * (1.0 + (sp.attention_forward_share if gc else 0.0))

    def exchange(self, op: Exchange, tokens: float) -> float:
        sp, n = self.sp, float(op.group)
        return tokens * op.per_token * (n - 1.0) / n / sp.bus(op.kind) + op.calls * sp.collective_latency

    def host_copy(self, op: HostCopy, tokens: float) -> float:
        """A CPU has no device to leave: the pack hook copies each tensor within RAM (read + write), the
        unpack hands it back as is; a calibrated GPU copies over its measured link."""
        nbytes = tokens * op.per_token
        if not self.sp.overlap_dispatch:  # a CPU
            return 2.0 * nbytes / self.sp.bandwidth
        return nbytes / self.sp.d2h + nbytes / self.sp.h2d

    def bytes(self, op: Bytes, tokens: float) -> float:
        return (tokens * op.per_token + op.fixed) / self.sp.bandwidth

    def dropout(self, op: Dropout, tokens: float) -> float:
        """A CPU's dropout forward costs its random draws, timed per value (``Speeds.dropout_value``)."""
        if self.sp.dropout_value > 0:
            return tokens * op.per_token * self.sp.dropout_value
        return tokens * op.per_token * 4.0 * op.e / self.sp.bandwidth

    def dequant(self, op: Dequant) -> tuple[float, float]:
        """(device, host) seconds: the values at the measured dequantisation rate, and each Linear4bit call's own
        cost (forward + input gradient; the forward again under checkpointing) — host work (bitsandbytes' Python
        and quant-state handling), so on a GPU it joins the dispatch."""
        sp = self.sp
        area = float(sum(k * n * c for k, n, c in op.shapes))
        calls = float(sum(c for k, n, c in op.shapes))
        calls_s = sp.dequant_call * op.layers * calls * op.uses / 2.0
        device = area * op.layers * op.uses / sp.dequant
        return (device, calls_s) if sp.overlap_dispatch else (device + calls_s, 0.0)

    def dispatch(self, op: Dispatch) -> float:
        return dispatch_seconds(op, self.sp) + op.extra_ops * self.sp.op_seconds

    def engine_hooks(self, op: EngineHooks) -> tuple[float, float]:
        return 0.0, 0.0  # the engines' host work on a CPU is timed per step (memfit.steptime.engine_host)

    def sync(self, ops: float) -> float:
        return 0.0

    def tensors(self, op: Tensors, b: float, s: float) -> float:
        """CPU: tensors above glibc's mmap threshold are new pages each time (memfit.steptime.cpu)."""
        if not self.sp.first_touch:
            return 0.0
        return self.sp.first_touch * fresh_bytes(b, s, op.heads, op.vocab, op.intermediate, op.layers, op.e,
                                                 op.eager, op.recompute, op.chunked_loss, mmap_threshold())
