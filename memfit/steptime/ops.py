"""One micro-batch's work as a list of typed ops (issue 37), after Calculon's layers: each op states what it
does — its FLOPs, the bytes it moves, the host ops it dispatches — and a device (memfit.steptime.micro: a
catalog GPU; memfit.steptime.measured: measured speeds) prices it. The list is built once per micro-batch
shape by memfit.steptime.layer from the model, the strategy, the method's ``LayerWork`` and the engine's
record; :func:`memfit.steptime.price.price` is the one code path that prices it on any device.

Ops hold per-token figures where the work scales with the tokens (``Linear.share``, ``Bytes.per_token``) so
that one list serves every sequence length and micro-batch (:class:`Work` carries those); every figure is
per micro-batch over all layers unless it says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Union


@dataclass(frozen=True)
class Linear:
    """A linear k -> n over ``share`` x the micro-batch's tokens, ``copies`` instances (layers x modules): the
    forward GEMM ``forwards`` times (2 when checkpointing recomputes it), the input gradient once, the weight
    gradient when ``weight_grad``."""

    k: float
    n: float
    share: float          # rows of its input per token (a mixture's expert: top-k / experts)
    copies: float         # instances per micro-batch
    forwards: float       # forward GEMMs per instance (2 under checkpointing)
    weight_grad: bool
    e: float              # bytes per value
    fp32: bool = False    # plain fp32 GEMMs (PEFT's fp32 adapters without autocast: no tensor cores)
    skinny: bool = False  # a rank-r product: measured devices time these at their skinny-GEMM rate
    dense: bool = True    # the base model's (dense FLOPs); else the adapter's

    def flops(self, tokens: float) -> float:
        return 2.0 * tokens * self.share * self.k * self.n * self.copies * (self.forwards + 1.0 + self.weight_grad)


@dataclass(frozen=True)
class Gemm:
    """A product of weight-sized matrices whatever the tokens (m x k)(k x n), ``count`` times (e.g. BOFT's
    rotation built every forward). Adapter work."""

    m: float
    n: float
    k: float
    count: float
    e: float

    def flops(self, tokens: float) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class Router:
    """A small trained product per token (MEFT's router, h x experts per layer): ``params`` weights, forward
    + both gradients. Adapter work."""

    params: float

    def flops(self, tokens: float) -> float:
        return 6.0 * tokens * self.params


@dataclass(frozen=True)
class Attention:
    """Scaled-dot-product attention over the micro-batch's sequences, every layer: forward + backward, the
    forward again when ``recompute``."""

    heads: int
    head_dim: int
    q_dim: int
    layers: int
    eager: bool
    recompute: bool
    e: float
    context: int = 1  # ranks sharing each sequence: each attends its share (heads / N over the whole sequence
    #                   under Ulysses; its queries over all keys under context parallelism) of N x the local length
    package: bool = False  # the flash-attn 2 package's kernel (attention: fa2), else torch SDPA's

    def flops(self, batch: float, seq: float) -> float:
        full = seq * self.context
        return 4.0 * batch * full * full * self.q_dim / self.context * self.layers * (4.0 if self.recompute else 3.0)


@dataclass(frozen=True)
class Bytes:
    """Memory-bound work: ``per_token`` x tokens + ``fixed`` bytes read and written, in kernels of ``size_per_token``
    x tokens + ``size`` bytes each (the transfer size sets the bandwidth a GPU kernel reaches)."""

    per_token: float
    fixed: float = 0.0
    size_per_token: float = 0.0
    size: float = 0.0


@dataclass(frozen=True)
class Dropout:
    """Dropout's forward on ``per_token`` x tokens values of ``e`` bytes (mask, read, write: 4 passes), in kernels
    of ``size_per_token`` x tokens bytes. A CPU times its random draws per value instead (measured)."""

    per_token: float
    e: float
    size_per_token: float


@dataclass(frozen=True)
class Dequant:
    """bitsandbytes' NF4 dequantisation of every Linear4bit weight per use: ``shapes`` (in, out, copies per
    layer), ``uses`` per micro-batch (forward, input gradient, the recomputed forward), over ``layers``."""

    shapes: tuple
    uses: float
    layers: int


@dataclass(frozen=True)
class Kernels:
    """Small kernels beyond the GEMMs (e.g. BOFT's per-block copies): a GPU pays a kernel's fixed time each."""

    count: float


@dataclass(frozen=True)
class Dispatch:
    """The host's module-level ops of the micro-batch, forward + backward, counted from transformers' and PEFT's
    code (memfit.steptime.work.ops_per_layer): ``layer_ops`` per decoder layer without adapters, ``adapter_ops``
    those of its ``adapters`` PEFT wrappers, ``extra_ops`` the method's own over all layers, ``quantized_calls``
    Linear4bit modules per layer (0: none), ``model_ops`` the model's outside its layers."""

    layers: int
    layer_ops: float
    adapter_ops: float
    adapters: int
    eager: bool
    recompute: bool
    extra_ops: float = 0.0
    quantized_calls: float = 0.0
    model_ops: float = 20.0  # embedding, final norm, head, loss, the model's Python (memfit.steptime.work)


@dataclass(frozen=True)
class EngineHooks:
    """The engine's host work per micro-batch (memfit.steptime.host prices it): ``units`` wrapped units whose
    pre/post forward and backward hooks run (FSDP), ``grad_tensors`` trainable tensors whose gradient hooks run
    (DeepSpeed ZeRO-1/2: every micro-batch under ZeRO-2, a 1/accumulation share under ZeRO-1), ``fetch_modules``
    submodule passes whose fetch / release the host waits on the device for (DeepSpeed ZeRO-3)."""

    units: float = 0.0
    grad_tensors: float = 0.0
    fetch_modules: float = 0.0


@dataclass(frozen=True)
class Exchange:
    """A collective among the ranks sharing each sequence, on the critical path: ``per_token`` bytes per local
    token of each rank's buffer, ``calls`` launches per micro-batch, over a group of ``group`` ranks (each sends
    (N - 1) / N of its buffer); ``intra_node``: the group sits in one node."""

    kind: str          # all_to_all (Ulysses) | all_gather (context parallelism's keys and values)
    per_token: float
    calls: float
    group: int
    intra_node: bool


@dataclass(frozen=True)
class HostCopy:
    """Offloaded activations: ``per_token`` bytes per local token copied device -> host in the forward and back
    in the backward, on the compute stream (transformers' offload, torch's save_on_cpu): waited for."""

    per_token: float


@dataclass(frozen=True)
class Sync:
    """Host synchronisations with the device (e.g. FourierFT's uploads), in module-level host ops over all
    layers: the host waits, and the device waits for the host after it."""

    ops: float


@dataclass(frozen=True)
class Tensors:
    """The large transient tensors the micro-batch allocates and frees: eager attention's b·H·s² scores, the
    b·s·V logits around the loss (none under the chunked loss), the b·s·f MLP intermediates, over ``layers``
    (the forward ones again when ``recompute``). A GPU's caching allocator reuses their blocks; a CPU maps
    fresh pages for them (memfit.steptime.cpu)."""

    heads: int
    vocab: int
    intermediate: float
    layers: int
    e: float
    eager: bool
    recompute: bool
    chunked_loss: bool


Op = Union[Linear, Gemm, Router, Attention, Bytes, Dropout, Dequant, Kernels, Dispatch, EngineHooks, Sync, Tensors,
           Exchange, HostCopy]


@dataclass(frozen=True)
class Work:
    """One micro-batch: its shape and its ops (memfit.steptime.layer builds it)."""

    batch: int
    seq: int
    ops: tuple
    key: tuple = ()  # what the ops were built from: the devices cache a priced micro-batch by it

    @property
    def tokens(self) -> float:
        return float(self.batch) * self.seq


class MicroBatch(NamedTuple):
    """One micro-batch priced on a device, seconds by part and FLOPs by kind."""

    seconds: float
    overlap_window: float   # device seconds collectives may hide behind (0: the device keeps no timeline apart)
    matmul_seconds: float
    attention_seconds: float
    memory_bound_seconds: float
    dequant_seconds: float
    dispatch_seconds: float
    exchange_seconds: float  # the sequence group's collectives (Ulysses, context parallelism)
    copy_seconds: float      # offloaded activations' copies
    dense_flops: float
    attention_flops: float
    adapter_flops: float
