"""Retrieval of the active neurons on the CPU: brute-force top-K, Key-Experts, and the batch union.

Key-Experts: the r neurons are split into E contiguous experts of ``expert_size`` neurons (the last may
be smaller). A router (d -> E, a small ``nn.Linear`` on the model's device, trained by the MEFT
optimizer) picks the top ``n_probe`` experts per token; only the keys inside those experts are scored
on the CPU, so a token costs d * (E + n_probe * r / E) multiply-adds instead of d * r. The router's
score enters the adapter as a gate on the key activation (see ``layer.py``), which is how it gets
gradients. The functions here return the number of keys they scored, for accounting and tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Selection(NamedTuple):
    neurons: torch.Tensor  # (N, k) long neuron ids, -1 where a slot holds no candidate
    keys_scored: int


class Union(NamedTuple):
    rows: torch.Tensor  # (u,) long, sorted neuron ids to place in the device buffers
    local: torch.Tensor  # (N, k) int32 index into rows; u for empty or dropped slots
    dropped: int  # (token, neuron) pairs dropped because the union exceeded the buffer


def brute_force_topk(x: torch.Tensor, keys: torch.Tensor, k: int) -> Selection:
    """Score every key for every token (x: N x d float32, keys: r x d) and keep the top k."""
    scores = x @ keys.T
    return Selection(scores.topk(k, dim=1).indices, x.shape[0] * keys.shape[0])


def key_experts_topk(
    x: torch.Tensor, keys: torch.Tensor, experts: torch.Tensor, expert_size: int, k: int
) -> Selection:
    """Score only the keys of each token's probed experts (experts: N x P expert ids) and keep top k.

    (token, probe) pairs are grouped by expert so each expert's keys meet all of its tokens in one
    matrix product; each expert's token rows are gathered into a small block just before it.
    """
    n, probes = experts.shape
    r = keys.shape[0]
    flat_exp = experts.reshape(-1).to(torch.long)
    order = torch.argsort(flat_exp, stable=True)  # (token, probe) pairs grouped by expert
    counts = torch.bincount(flat_exp, minlength=(r + expert_size - 1) // expert_size).tolist()
    tokens = order // probes
    sorted_scores = torch.full((n * probes, expert_size), float("-inf"), dtype=torch.float32)
    # one small, cache-resident block of token rows per expert (gathered just before its product)
    block = torch.empty(max(counts) if counts else 0, x.shape[1], dtype=x.dtype)
    scored = 0
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        lo, hi = e * expert_size, min((e + 1) * expert_size, r)
        rows = block[:count]
        torch.index_select(x, 0, tokens[start:start + count], out=rows)
        # keys (s x d) times tokens^T: this operand order runs faster in CPU BLAS than tokens x keys^T
        sorted_scores[start:start + count, : hi - lo] = (keys[lo:hi] @ rows.T).T
        scored += count * (hi - lo)
        start += count
    cand = torch.empty_like(sorted_scores)
    cand[order] = sorted_scores
    cand = cand.view(n, probes * expert_size)
    kk = min(k, cand.shape[1])
    top_val, top_pos = cand.topk(kk, dim=1)
    base = experts.to(torch.long).gather(1, top_pos // expert_size) * expert_size
    neurons = base + top_pos % expert_size
    neurons[torch.isinf(top_val)] = -1
    if kk < k:
        neurons = torch.cat([neurons, neurons.new_full((n, k - kk), -1)], dim=1)
    return Selection(neurons, scored)


def batch_union(neurons: torch.Tensor, cap: int) -> Union:
    """Union of the batch's selected neurons, keeping the ``cap`` most-selected when it is larger."""
    n, k = neurons.shape
    valid = neurons >= 0
    flat = neurons[valid]
    rows, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
    dropped = 0
    if rows.numel() > cap:
        # most-selected first; ties by lower neuron id (a stable, deterministic order)
        order = torch.argsort(-counts, stable=True)[:cap]
        keep = order.sort().values
        remap = torch.full((rows.numel(),), -1, dtype=torch.long)
        remap[keep] = torch.arange(cap)
        inverse = remap[inverse]
        rows = rows[keep]
        dropped = int((inverse < 0).sum())
    u = rows.numel()
    local = torch.full((n, k), u, dtype=torch.int32)
    local[valid] = torch.where(inverse >= 0, inverse, u).to(torch.int32)
    return Union(rows, local, dropped)


class KeyExpertsRouter(nn.Module):
    """d -> E router scores, kept in float32 on the model's device (trained by the MEFT optimizer)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(self.weight.dtype), self.weight)

    @torch.no_grad()
    def init_from_keys(self, keys: torch.Tensor, expert_size: int) -> None:
        """Each expert's router row starts as the mean of its keys, so routing follows key scores."""
        r = keys.shape[0]
        rows = []
        for e in range(self.weight.shape[0]):
            block = keys[e * expert_size:min((e + 1) * expert_size, r)]
            rows.append(block.mean(0) if block.numel() else torch.zeros(keys.shape[1]))
        self.weight.copy_(torch.stack(rows).to(self.weight.device))
