"""First-touch page faults on a CPU: what a training step pays for tensors above glibc's mmap threshold.

glibc's malloc (malloc/malloc.c) serves a request of at least ``mmap_threshold`` bytes with a fresh
``mmap`` and returns it with ``munmap`` when freed; the threshold starts at 128 kB and rises with the
chunks freed, up to ``DEFAULT_MMAP_THRESHOLD_MAX`` = 4 MiB x sizeof(long) = 32 MiB on 64-bit, unless
``MALLOC_MMAP_THRESHOLD_`` fixes it. PyTorch's CPU allocator calls malloc directly (no caching), so every
such tensor is new memory: the kernel maps and zeroes each page on its first touch. Measured on this
project's 2-core VM: eager attention at s = 1024 (33.5 MB scores) spent ~35 % of its step there
(1,482 vs 954 ms with the threshold raised above the scores; docs/time-log.md).

Which tensors: the b·H·s² score matrices of eager attention (its matmul, scale, mask add and fp32 softmax
outputs in the forward, three gradients in the backward), the b·s·V logits around the loss (the head's
output, its fp32 upcast, log-softmax, and their gradients) and the b·s·f MLP intermediates (gate, up, the
activation and product, and their gradients); the forward ones again under checkpointing. Smaller
tensors come from the heap, whose pages stay mapped.
"""

from __future__ import annotations

import os

GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # 64-bit glibc: 4 MiB x sizeof(long)
GLIBC_SETTLED_TRIM_THRESHOLD = 2 * GLIBC_MMAP_THRESHOLD_MAX  # free() raises trim to twice the mmap threshold


def mmap_threshold() -> float:
    """The threshold this process's malloc uses: ``MALLOC_MMAP_THRESHOLD_`` if set, else glibc's
    dynamic one, which settles at its 32 MiB ceiling once tensors of that size have been freed."""
    env = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return float(env) if env.isdigit() else float(GLIBC_MMAP_THRESHOLD_MAX)


def fresh_bytes(b: int, s: int, heads: int, vocab: int, ff: float, layers: int, e: float, eager: bool,
                gc: bool, chunked_loss: bool, threshold: float) -> float:
    """Bytes of tensors at or above ``threshold`` one micro-batch allocates (forward + backward)."""
    redo = 1.0 if gc else 0.0

    def big(nbytes: float, count: float) -> float:
        return nbytes * count if nbytes >= threshold else 0.0
    out = 0.0
    if eager:
        scores = float(b) * heads * s * s
        out += layers * (big(scores * e, 3.0 * (1 + redo)) + big(scores * 4.0, 1.0 + redo) + big(scores * e, 3.0))
    if not chunked_loss:
        logits = float(b) * s * vocab
        out += big(logits * e, 2.0) + big(logits * 4.0, 3.0)
    mlp = float(b) * s * ff * e
    out += layers * big(mlp, 4.0 * (1 + redo) + 4.0)
    return out


def step_fresh_bytes(tensors: list[float], threshold: float, e_grad: float) -> float:
    """Bytes of tensors at or above ``threshold`` one optimizer step allocates beside the micro-batches, for
    the trainable tensors of ``tensors`` values each: a new gradient every step (the HF Trainer's
    ``model.zero_grad()`` sets them to None, torch's default), and AdamW's two fp32 temporaries per tensor on
    a CPU, where torch has no foreach kernels and takes the single-tensor path (torch 2.13 optim/adam.py
    ``_single_tensor_adam``: ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``). A 6-layer
    h-256 Llama with a 50k vocabulary: its embedding and head (51 MB each) take 177k page faults and 260 ms
    of system time per step at 1 x 512 (docs/time.md "Large vocabularies")."""
    out = 0.0
    for n in tensors:
        out += (n * e_grad if n * e_grad >= threshold else 0.0) + (2.0 * n * 4.0 if n * 4.0 >= threshold else 0.0)
    return out


# torch's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp at torch 2.13,
# flash_attention_kernel_impl / flash_attention_backward_kernel_impl): query blocks of 256 rows from 768 tokens,
# 64 from 192, else 32; key blocks of 512. A causal query block stops after the key block that holds its last
# row, so the scores above the diagonal are skipped only in whole 512-key blocks (cpu_flash_work)
CPU_FLASH_Q_BLOCKS = ((768, 256), (192, 64), (0, 32))
CPU_FLASH_KV_BLOCK = 512
# 192: below it the 32-row query blocks run ~15 % slower per score (docs/time.md, "attention")
CPU_FLASH_SHORT = CPU_FLASH_Q_BLOCKS[1][0]


def cpu_flash_work(seq: float) -> float:
    """The share of the s² causal scores torch's CPU flash kernel computes, forward and backward alike:
    1.0 up to 512 tokens (one key block), 0.78 at 768, 0.75 at 1024, 0.63 at 2048. Per computed score its
    speed is flat: d = 16 ran at 34, 34, 33, 33 GFLOP/s per computed score at 256, 512, 768, 1024 tokens on
    this CPU where the s² count read 34, 34, 42, 44 (docs/time.md, "attention")."""
    s = max(1, int(round(seq)))
    q = next(rows for start, rows in CPU_FLASH_Q_BLOCKS if s >= start)
    done = 0
    for m in range(0, s, q):
        rows = min(q, s - m)
        done += rows * min(-(-(m + rows) // CPU_FLASH_KV_BLOCK) * CPU_FLASH_KV_BLOCK, s)
    return done / float(s * s)
